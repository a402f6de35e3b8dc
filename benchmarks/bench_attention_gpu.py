"""Paged attention kernels on the GPU: correctness against the references, then timings.

    python benchmarks/bench_attention_gpu.py                      # on a CUDA device, no downloads
    python benchmarks/bench_attention_gpu.py --device cpu --interpret   # tiny shapes, interpreter

Decode: every request has ``context`` cached tokens and one query token, for the Qwen2.5-0.5B
(14 q / 2 KV heads, head 64) and Llama-3.1-8B (32 q / 8 KV heads, head 128) shapes. Compared:
Triton with the automatic split count (flash-decoding), Triton with one split, and the PyTorch
reference backend's decode (gather the blocks, then SDPA with cuDNN off). GB/s counts the K/V
bytes each request must read (context x KV heads x head size x 2 x dtype size) over the time.
Prefill: chunks over cached context through the mixed-batch kernel, in TFLOP/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "libs" / "kernels"))

MODELS = {"qwen": (14, 2, 64), "llama": (32, 8, 128)}  # (query heads, KV heads, head size)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--interpret", action="store_true", help="Triton interpreter, tiny shapes")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--models", default="qwen,llama")
    p.add_argument("--batches", default=None, help="comma-separated; default 1,64,256")
    p.add_argument("--contexts", default=None, help="default 512,1024,2048,4096,8192")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument(
        "--sweep",
        default="",
        help="comma-separated: configs (decode launch), splits (decode), prefill (launch)",
    )
    p.add_argument(
        "--best-out", default="", help="--sweep prefill writes its best launch per head size here"
    )
    p.add_argument(
        "--points", default="", help="the sweeps' points instead of theirs: model:batch:context,..."
    )
    return p.parse_args()


args = parse_args()
if args.interpret:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from kv_pools import scattered_pool  # noqa: E402

from baton_kernels.attention import AttentionMetadata, KVCacheView  # noqa: E402
from baton_kernels.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from baton_kernels.triton.decode_attention import (  # noqa: E402
    choose_num_splits,
    decode_attention,
    ref_decode_attention,
)
from baton_kernels.triton.paged_attention import (  # noqa: E402
    LONG_CHUNK_CONFIGS,
    PrefillConfig,
    paged_attention,
    ref_paged_attention,
)

DEVICE = torch.device(args.device)
DTYPE = getattr(torch, DTYPES[args.dtype])
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
if DEVICE.type == "cuda":
    torch.backends.cuda.enable_cudnn_sdp(False)  # recompiles per KV length on this image


def bench_ms(fn: Callable[[], object], graph: bool = True) -> float:
    """Milliseconds per call: replayed from a CUDA graph (device time, no launch overhead) or
    launched eagerly from Python; on CPU one timed call."""
    if DEVICE.type == "cuda":
        if graph:
            return float(triton.testing.do_bench_cudagraph(fn, rep=50))
        return float(triton.testing.do_bench(fn, warmup=10, rep=50))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def make_cache(
    seq_lens: list[int], num_kv_heads: int, head_dim: int
) -> tuple[KVCacheView, torch.Tensor]:
    """Layer 0 of a two-layer block-major pool, blocks scattered at random."""
    views, table = scattered_pool(
        seq_lens, num_kv_heads, head_dim, block_size=args.block_size, dtype=DTYPE, device=DEVICE
    )
    return views[0], table


def decode_row(model: str, batch: int, context: int) -> str:
    num_heads, num_kv_heads, head_dim = MODELS[model]
    seq_lens = [context] * batch
    cache, tables = make_cache(seq_lens, num_kv_heads, head_dim)
    query = torch.randn(batch, num_heads, head_dim, device=DEVICE).to(DTYPE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    scale = head_dim**-0.5
    splits = choose_num_splits(batch, num_kv_heads, context, DEVICE)
    out = torch.empty_like(query)
    out_1 = torch.empty_like(query)

    def triton_auto() -> None:
        decode_attention(query, cache, out, lens, tables, scale, splits)

    def triton_one() -> None:
        decode_attention(query, cache, out_1, lens, tables, scale, 1)

    num_blocks = math.ceil(context / args.block_size)
    past_end = torch.arange(num_blocks * args.block_size, device=DEVICE) >= context
    bias = torch.zeros(batch, past_end.shape[0], dtype=DTYPE, device=DEVICE)
    bias.masked_fill_(past_end, -math.inf)
    md = AttentionMetadata(
        num_reqs=batch,
        num_decodes=batch,
        num_tokens=batch,
        query_start_loc=list(range(batch + 1)),
        seq_lens=seq_lens,
        block_tables=tables,
        slot_block=lens,
        slot_offset=lens,
        decode_bias=bias.view(batch, 1, 1, -1),
        max_decode_blocks=num_blocks,
    )
    torch_backend = TorchAttentionBackend()

    def torch_ref() -> torch.Tensor:
        return torch_backend._decode(query, cache, md, scale)

    triton_auto()
    triton_one()
    check = min(batch, 4)
    want = ref_decode_attention(query[:check], cache, seq_lens[:check], tables[:check], scale)
    err = max(
        (out[:check].float() - want).abs().max().item(),
        (out_1[:check].float() - want).abs().max().item(),
        (torch_ref()[:check].float() - want).abs().max().item(),
    )
    ok = "ok" if err <= TOL[DTYPE] * 4 else "FAIL"
    kv_bytes = batch * context * num_kv_heads * head_dim * 2 * query.element_size()
    times = [bench_ms(f) for f in (triton_auto, triton_one, torch_ref)]
    cells = [f"{t * 1e3:9.1f} {kv_bytes / t / 1e6:7.0f}" for t in times]
    eager = bench_ms(triton_auto, graph=False)
    return (
        f"{model:6} {batch:5} {context:6} {splits:6} "
        + " ".join(cells)
        + f" {eager * 1e3:9.1f}  {err:.1e} {ok}"
    )


def sweep_splits() -> None:
    """Decode GB/s (graph-timed) for each split count; choose_num_splits's pick is marked *."""
    points = [("qwen", 1, 8192), ("qwen", 64, 512), ("qwen", 64, 2048), ("qwen", 64, 8192)]
    points += [("qwen", 256, 512), ("llama", 1, 2048), ("llama", 1, 8192), ("llama", 16, 4096)]
    points += [("llama", 64, 512)]
    points = given_points() or points
    print("\n## decode split count: GB/s for num_splits")
    for model, batch, context in points:
        num_heads, num_kv_heads, head_dim = MODELS[model]
        cache, tables = make_cache([context] * batch, num_kv_heads, head_dim)
        query = torch.randn(batch, num_heads, head_dim, device=DEVICE).to(DTYPE)
        lens = torch.full((batch,), context, device=DEVICE)
        out = torch.empty_like(query)
        pick = choose_num_splits(batch, num_kv_heads, context, DEVICE)
        kv_bytes = batch * context * num_kv_heads * head_dim * 2 * query.element_size()
        cells = []
        for splits in (1, 2, 3, 4, 6, 8, 16, 32, 64):
            run = functools.partial(decode_attention, query, cache, out, lens, tables, 0.1, splits)
            gbs = kv_bytes / bench_ms(run) / 1e6
            cells.append(f"{splits}{'*' if splits == pick else ''}:{gbs:.0f}")
        print(f"{model:6} b{batch:<4} ctx {context:5}  " + " ".join(cells), flush=True)
        del cache, tables
        torch.cuda.empty_cache()


def given_points() -> list[tuple[str, int, int]]:
    """``--points``: (model, batch, context) triples."""
    points = []
    for item in filter(None, args.points.split(",")):
        model, batch, context = item.split(":")
        points.append((model, int(batch), int(context)))
    return points


def sweep_configs() -> None:
    """Decode launch configurations at a few points, graph-timed; the default is marked *."""
    points = [("llama", 1, 8192), ("llama", 64, 4096), ("llama", 256, 2048)]
    points += [("qwen", 1, 8192), ("qwen", 64, 2048), ("qwen", 256, 4096)]
    points = given_points() or points
    print("\n## decode sweep: GB/s for (tile_n, num_warps, num_stages)")
    for model, batch, context in points:
        print(sweep_point(model, batch, context), flush=True)
        torch.cuda.empty_cache()


def sweep_point(model: str, batch: int, context: int) -> str:
    num_heads, num_kv_heads, head_dim = MODELS[model]
    cache, tables = make_cache([context] * batch, num_kv_heads, head_dim)
    query = torch.randn(batch, num_heads, head_dim, device=DEVICE).to(DTYPE)
    lens = torch.full((batch,), context, device=DEVICE)
    out = torch.empty_like(query)
    splits = choose_num_splits(batch, num_kv_heads, context, DEVICE)
    kv_bytes = batch * context * num_kv_heads * head_dim * 2 * query.element_size()
    default = (64, 2, 3) if head_dim >= 128 else (128, 4, 3)
    results = []
    for config in [(t, w, st) for t in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3, 4)]:
        run = functools.partial(
            decode_attention, query, cache, out, lens, tables, 0.1, splits,
            tile_n=config[0], num_warps=config[1], num_stages=config[2],
        )  # fmt: skip
        try:
            results.append((kv_bytes / bench_ms(run) / 1e6, config))
        except Exception as e:  # e.g. out of shared memory for big tiles
            results.append((0.0, config))
            print(f"  {config}: {type(e).__name__}")
    base = next(gbs for gbs, c in results if c == default)
    results.sort(reverse=True)
    top = ", ".join(f"{c}{'*' if c == default else ''} {gbs:.0f}" for gbs, c in results[:5])
    return f"{model:6} b{batch:<4} ctx {context:5} splits {splits:2}: default {base:.0f}; {top}"


class PrefillCase:
    """``num_chunks`` query chunks of ``chunk`` tokens, each over ``context`` cached keys (its
    new tokens' K/V already in the cache), with the reference output of the first chunk."""

    def __init__(self, model: str, num_chunks: int, chunk: int, context: int) -> None:
        num_heads, num_kv_heads, self.head_dim = MODELS[model]
        self.chunk = chunk
        seq_lens = [context + chunk] * num_chunks
        self.cache, self.tables = make_cache(seq_lens, num_kv_heads, self.head_dim)
        qsl = [i * chunk for i in range(num_chunks + 1)]
        self.query = torch.randn(qsl[-1], num_heads, self.head_dim, device=DEVICE).to(DTYPE)
        self.out = torch.empty_like(self.query)
        self.qsl = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)
        self.lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.scale = self.head_dim**-0.5
        self.want = ref_paged_attention(
            self.query[:chunk], self.cache, qsl[:2], seq_lens[:1], self.tables[:1], self.scale
        )[:chunk]
        # causal: each query row sees context + its position + 1 keys; 2 matmuls of 2 flops each
        keys = num_chunks * (chunk * context + chunk * (chunk + 1) / 2)
        self.flops = 4 * keys * num_heads * self.head_dim

    def run(self, config: PrefillConfig | None = None) -> None:
        paged_attention(
            self.query, self.cache, self.out, self.qsl, self.lens, self.tables, self.scale,
            self.chunk, config=config,
        )  # fmt: skip

    def error(self) -> float:
        return float((self.out[: self.chunk].float() - self.want).abs().max().item())

    def tflops(self, config: PrefillConfig | None = None) -> tuple[float, str]:
        """TFLOP/s (graph-timed) and "ok"/"FAIL" for the first chunk's output."""
        self.out.fill_(float("nan"))
        self.run(config)
        ok = "ok" if self.error() <= TOL[DTYPE] * 4 else "FAIL"
        return self.flops / bench_ms(functools.partial(self.run, config)) / 1e9, ok


def prefill_row(model: str, num_chunks: int, chunk: int, context: int) -> str:
    case = PrefillCase(model, num_chunks, chunk, context)
    tflops, ok = case.tflops()
    t = case.flops / tflops / 1e9
    return (
        f"{model:6} {num_chunks:6} {chunk:6} {context:7} {t * 1e3:10.1f} "
        f"{tflops:8.1f}  {case.error():.1e} {ok}"
    )


def measure_prefill(
    cases: list[PrefillCase], config: PrefillConfig, default: bool
) -> tuple[float, list[str]]:
    """The geometric mean of TFLOP/s over the cases (0 if any failed) and each case's cell,
    printed as a line (marked * for the default launch)."""
    cells, logs = [], 0.0
    for case in cases:
        try:
            tflops, ok = case.tflops(config)
        except Exception as e:  # e.g. out of shared memory for big tiles
            cells.append(type(e).__name__)
            logs = -math.inf
            break
        cells.append(f"{tflops:6.1f}{'' if ok == 'ok' else ' FAIL'}")
        logs += math.log(tflops) if ok == "ok" else -math.inf
    mean = math.exp(logs / len(cases))
    print(f"  {'*' if default else ' '}{tuple(config)!s:30} mean {mean:6.1f}: " + " ".join(cells))
    return mean, cells


def sweep_prefill() -> dict[int, PrefillConfig]:
    """Prompt-attention launches (rows, keys per tile, warps, stages) at the issue's prompt step
    (32 chunks of 512), one 8,192-token prompt and 8 chunks of 512 over 4,096 cached keys; the
    top three by geometric mean again with the heaviest q-blocks first. Returns the best launch
    per head size."""
    points = [(32, 512, 0), (1, 8192, 0), (8, 512, 4096)]
    configs = [
        PrefillConfig(r, t, w, st)
        for r in (64, 128) for t in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)
    ]  # fmt: skip
    best: dict[int, PrefillConfig] = {}
    print("\n## prefill sweep: TFLOP/s at (chunks, chunk, context) for (rows, tile, warps, stages)")
    for model in args.models.split(","):
        cases = [PrefillCase(model, *p) for p in points]
        default = LONG_CHUNK_CONFIGS[cases[0].head_dim]
        print(f"{model}: points {points}; the default is marked *")
        results: dict[PrefillConfig, tuple[float, list[str]]] = {}
        for c in configs:
            results[c] = measure_prefill(cases, c, c == default)
        for c in sorted(results, key=lambda c: -results[c][0])[:3]:
            heavy = c._replace(heavy_first=True)
            results[heavy] = measure_prefill(cases, heavy, heavy == default)
        if default not in results:
            results[default] = measure_prefill(cases, default, True)
        ranked = sorted(results, key=lambda c: -results[c][0])
        print(f"{model} best: " + ", ".join(f"{tuple(c)} {results[c][0]:.1f}" for c in ranked[:4]))
        best[cases[0].head_dim] = ranked[0]
        del cases
        torch.cuda.empty_cache()
    return best


def main() -> None:
    tiny = args.interpret or DEVICE.type == "cpu"
    batches = [int(x) for x in (args.batches or ("1,2" if tiny else "1,64,256")).split(",")]
    default_contexts = "64,600" if tiny else "512,1024,2048,4096,8192"
    contexts = [int(x) for x in (args.contexts or default_contexts).split(",")]
    name = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu (interpreter)"
    print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}, "
          f"block_size {args.block_size}")  # fmt: skip
    print("\n## decode: us per call replayed in a CUDA graph, GB/s of K/V read; eager: triton")
    print("## launched from Python (includes host launch overhead)")
    columns = ["triton", "GB/s", "1-split", "GB/s", "torch", "GB/s", "eager"]
    print(f"{'model':6} {'batch':>5} {'ctx':>6} {'splits':>6} ", end="")
    print(" ".join(f"{c:>{9 if i % 2 == 0 else 7}}" for i, c in enumerate(columns)) + "  err")
    for model in args.models.split(","):
        for batch in batches:
            for context in contexts:
                print(decode_row(model, batch, context), flush=True)
                if DEVICE.type == "cuda":
                    torch.cuda.empty_cache()
    sweeps = set(filter(None, args.sweep.split(",")))
    if "configs" in sweeps and DEVICE.type == "cuda":
        sweep_configs()
    if "splits" in sweeps and DEVICE.type == "cuda":
        sweep_splits()
    if "prefill" in sweeps and DEVICE.type == "cuda":
        best = sweep_prefill()
        if args.best_out:
            with open(args.best_out, "w") as f:
                json.dump({d: list(c) for d, c in best.items()}, f)
    if args.no_prefill:
        return
    print("\n## prefill chunks over cached context (mixed-batch kernel): time in us, TFLOP/s")
    print(
        f"{'model':6} {'chunks':>6} {'chunk':>6} {'context':>7} {'triton':>10} {'TFLOP/s':>8}  err"
    )
    cases = [(2, 16, 40)] if tiny else [(4, 2048, 0), (8, 512, 4096), (1, 8192, 0)]
    for model in args.models.split(","):
        for num_chunks, chunk, context in cases:
            print(prefill_row(model, num_chunks, chunk, context), flush=True)


if __name__ == "__main__":
    main()
