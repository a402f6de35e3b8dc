"""SiLU-and-multiply inside the down projection (``silu_linear.silu_and_mul_linear``, one Triton
launch) against the unfused kernels it replaces, on the H200 (issue 5).

    python benchmarks/bench_silu_linear_gpu.py [--shapes qwen,llama] [--output-json F]
    python benchmarks/bench_silu_linear_gpu.py --smoke     # CPU, interpreter: one case checked

Points: the decode step's MLP at 64 and 256 rows, norms folded (the unfused path:
``silu_and_mul(norm_of=)`` then cuBLAS ``addmm_`` into the stream: three launches, cuBLAS
splitting K), and a prompt step's at 16,384 rows for Qwen, 4,096 for Llama (unfused:
``silu_and_mul`` then ``F.linear``). Each point is timed in a CUDA graph that calls it once on
each of enough copies of the inputs and weight to defeat the L2, as the decode step meets them
(each layer's weight once per step), over a sweep of tile shapes and K splits; each
configuration's output is checked against the unfused path's. Prints per point the unfused time,
the best configuration's and the default's, and writes the best configuration per point to the
JSON file (``--output-json``, default ``$OUT/bench_silu_linear_gpu.json``) as it goes, so that a
run cut short keeps the points done.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from baton_kernels.triton.fused_ops import silu_and_mul
from baton_kernels.triton.silu_linear import (
    SiluLinearConfig,
    default_config,
    ref_silu_and_mul_linear,
    silu_and_mul_linear,
)

SHAPES = {"qwen": (896, 4864), "llama": (4096, 14336)}  # (hidden N, intermediate K)
PROMPT_ROWS = {"qwen": 16384, "llama": 4096}
EPS = 1e-6
Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]  # (x, weight, stream)
L2_BYTES = 160 << 20  # copies of the inputs until a graph's calls touch this much


def decode_configs(m: int) -> list[SiluLinearConfig]:
    """K split 2-8 ways (16 for a few): at N = 896 and 64-256 rows the tiles alone are 7-56
    programs for 132 SMs."""
    block_ms = (16, 32) if m <= 64 else (32, 64, 128)
    out = [
        SiluLinearConfig(bm, bn, bk, split, 4, 3)
        for bm, bn, bk, split in itertools.product(block_ms, (64, 128), (64, 128), (2, 4, 8))
    ]
    out += [SiluLinearConfig(bm, 128, 64, 16, 4, 3) for bm in block_ms]
    return out


PROMPT_CONFIGS = [
    SiluLinearConfig(*c)
    for c in [
        (128, 128, 64, 1, 8, 3), (128, 128, 64, 1, 4, 3), (128, 256, 64, 1, 8, 3),
        (64, 128, 64, 1, 4, 4), (128, 64, 64, 1, 4, 4), (64, 256, 64, 1, 8, 3),
        (128, 256, 32, 1, 8, 4),
    ]
]  # fmt: skip


def refine(best: list[tuple[float, SiluLinearConfig]]) -> list[SiluLinearConfig]:
    """The two best of the first pass with other warps and pipeline stages."""
    out = []
    for _, cfg in best[:2]:
        for warps, stages in ((4, 4), (8, 3), (4, 2)):
            out.append(cfg._replace(num_warps=warps, num_stages=stages))
    return out


def graph_time_us(calls: list[Callable[[], object]], rounds: int = 7) -> float:
    """Median time per call of a CUDA graph that makes every call of ``calls`` once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def point(name: str, m: int, n: int, k: int, decode: bool) -> dict[str, object]:
    dev = torch.device("cuda")
    per_copy = (m * 2 * k + n * k + m * n) * 2
    copies = max(1, min(16, L2_BYTES // per_copy))
    g = torch.Generator(device=dev).manual_seed(0)
    sets = []
    for _ in range(copies):
        x = torch.randn(m, 2 * k, device=dev, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        stream = torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16)
        sets.append((x, w, stream))
    x, w, stream = sets[0]
    kw: dict[str, object] = dict(residual=stream, norm_of=stream, eps=EPS) if decode else {}
    want = ref_silu_and_mul_linear(x, w, **kw)  # type: ignore[arg-type]

    def unfused(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> object:
        if decode:
            return s.addmm_(silu_and_mul(x, norm_of=s, eps=EPS), w.t())
        return F.linear(silu_and_mul(x), w)

    def fused(cfg: SiluLinearConfig) -> Call:
        def call(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> object:
            if decode:
                return silu_and_mul_linear(x, w, residual=s, norm_of=s, eps=EPS, config=cfg)
            return silu_and_mul_linear(x, w, config=cfg)

        return call

    def timed(fn: Call) -> float:
        return graph_time_us([lambda s=s, fn=fn: fn(*s) for s in sets])

    # the unfused path adds into the stream in place: timed on copies of the streams
    saved = [s[2].clone() for s in sets]
    t_unfused = timed(unfused)
    for s, orig in zip(sets, saved, strict=True):
        s[2].copy_(orig)
    results: list[tuple[float, SiluLinearConfig]] = []
    failed = 0

    def sweep(configs: list[SiluLinearConfig]) -> None:
        nonlocal failed
        for cfg in configs:
            try:
                got = fused(cfg)(x, w, stream)
                assert isinstance(got, torch.Tensor)
                torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
                results.append((timed(fused(cfg)), cfg))
            except Exception as e:  # out of resources, or wrong: skipped, counted
                failed += 1
                if "resources" not in str(e):
                    print(f"  {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        results.sort(key=lambda r: r[0])

    sweep(decode_configs(m) if decode else PROMPT_CONFIGS)
    sweep(refine(results))
    default = default_config(m, n, k)
    t_default = timed(fused(default))
    best_t, best = results[0] if results else (float("nan"), default)
    flops = 2 * m * n * k
    print(
        f"{name:14} M={m:>5} N={n:>5} K={k:>5}: unfused {t_unfused:8.2f} us; fused best "
        f"{best_t:8.2f} us ({flops / best_t / 1e6:4.0f} TFLOP/s) {tuple(best)}; default "
        f"{t_default:8.2f} us {tuple(default)}; {len(results)} configs timed, {failed} failed, "
        f"{copies} copies",
        flush=True,
    )
    return {
        "point": name, "m": m, "n": n, "k": k, "decode": decode, "unfused_us": t_unfused,
        "best_us": best_t, "best": list(best), "default_us": t_default, "default": list(default),
        "top5": [[t, list(c)] for t, c in results[:5]],
    }  # fmt: skip


def smoke() -> int:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 2 * 40, generator=g)
    w = torch.randn(24, 40, generator=g) * 0.1
    s = torch.randn(20, 24, generator=g)
    for cfg in (SiluLinearConfig(16, 16, 16, 1), SiluLinearConfig(16, 16, 16, 2)):
        got = silu_and_mul_linear(x, w, residual=s, norm_of=s, eps=EPS, config=cfg)
        want = s.clone().addmm_(silu_and_mul(x, norm_of=s, eps=EPS), w.t())
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    print("smoke: ok")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="qwen,llama")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        return smoke()
    out = args.output_json or Path(os.environ.get("OUT", "benchmarks/out"))
    if out.suffix != ".json":
        out = out / "bench_silu_linear_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    start = time.perf_counter()
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        # the decode step at 256 first: the point that matters most if time runs out
        for m, decode in ((256, True), (PROMPT_ROWS[shape], False), (64, True)):
            kind = "decode" if decode else "prompt"
            results.append(point(f"{shape} {kind}", m, n, k, decode))
            out.write_text(json.dumps(results, indent=2))
            print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
