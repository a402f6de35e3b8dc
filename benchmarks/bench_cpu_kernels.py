"""The CPU kernels of a decode step on the default model's shapes (SmolLM2-135M, bf16), timed
against what they replace, in one process.

    python benchmarks/bench_cpu_kernels.py [--rows 1,4,8,12,16,24,32,64,128,512,2048]

- linear: one step's 121 linear layers (30 x qkv 576->960, o 576->576, gate_up 576->3072,
  down 1536->576, and the LM head 576->49152), each with its own weight (so they stream from
  memory as in the engine), oneDNN's packed GEMM vs the AVX512-BF16 kernel, and on AMX CPUs
  that kernel's tile path (the same packed weight), per row count.
- attention: ``paged_decode_attention`` over 30 layers of a block-major pool, 16 requests at
  context 130-250; once reading each layer from memory, once the same layer again (in cache);
  a bf16 pool, then an FP8 one (e4m3, ``--kv-cache-dtype fp8``: the rows widened as read).
- prompt attention: one layer's attention (with the K/V write) for 16 fresh 128-token prompts
  and for a 512-token chunk after 1,536 cached tokens, the reference backend (gather + SDPA)
  vs the CPU backend's in-place ``paged_attention``; the chunk again with a sliding window of
  256 and with a softcap of 50 (the reference masks, or computes by hand in float32); the chunk
  over an FP8 cache.
- argmax: 16 rows of 49,152 float32 logits, torch vs the C++ kernel.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from baton_kernels.cpu_linear import PackedLinear, vnni_ops
from baton_kernels.cpu_ops import load_cpu_ops

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LAYERS = 30


def per_call(fn: Callable[[], object], repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def bench_linear(rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).mul(0.02) for _ in range(LAYERS) for i, o in SHAPES]
    weights.append(torch.randn(49152, 576, generator=gen).mul(0.02))
    ops = vnni_ops()
    kernels = ["onednn"] + (["vnni"] if ops is not None else [])
    kernels += ["amx"] if ops is not None and ops.amx_gemm_available() else []
    layers: dict[str, list[PackedLinear]] = {}
    for kernel in kernels:
        layers[kernel] = []
        for w in weights:
            linear = nn.Linear(w.shape[1], w.shape[0], bias=False).to(torch.bfloat16)
            linear.weight.data.copy_(w)
            packing = "vnni" if kernel == "amx" else kernel  # (one packed layout for both)
            layers[kernel].append(PackedLinear(linear, kernel=packing))
    nbytes = sum(w.numel() * 2 for w in weights)
    print(f"linear: one decode step's {len(weights)} layers ({nbytes / 1e6:.0f} MB of weights)")
    print("| rows | " + " | ".join(f"{k} ms" for k in kernels) + " | GFLOP/s | GB/s |")
    print("|---|" + "---|" * (len(kernels) + 2))
    with torch.no_grad():
        for m in rows:
            xs = {i: torch.randn(m, i, generator=gen).to(torch.bfloat16) for i in (576, 1536)}
            times = []
            for kernel in kernels:

                def step(kernel: str = kernel, xs: dict[int, torch.Tensor] = xs) -> None:
                    for layer in layers[kernel]:
                        layer(xs[layer.in_features])

                amx = ops.use_amx_gemm(kernel == "amx") if ops is not None else False
                times.append(per_call(step, 5 if m < 128 else 2))
                if ops is not None:
                    ops.use_amx_gemm(amx)
            best = min(times)
            print(
                f"| {m} | " + " | ".join(f"{t * 1e3:.1f}" for t in times) + f" | "
                f"{m * nbytes / best / 1e9:.0f} | {nbytes / best / 1e9:.1f} |"
            )


def bench_attention() -> None:
    ops = load_cpu_ops()
    if ops is None:
        print("attention: the C++ kernels are not built")
        return
    gen = torch.Generator().manual_seed(0)
    reqs, block, kv_heads, heads, dim = 16, 16, 3, 9, 64
    lens = [130 + 8 * i for i in range(reqs)]
    per_req = [-(-n // block) for n in lens]
    total = sum(per_req) + 8
    pool16 = torch.randn(total, LAYERS, 2, block, kv_heads, dim, generator=gen).to(torch.bfloat16)
    order = torch.randperm(total, generator=gen)
    tables = torch.zeros(reqs, max(per_req), dtype=torch.int64)
    used = 0
    for r, n in enumerate(per_req):
        tables[r, :n] = order[used : used + n]
        used += n
    q = torch.randn(reqs, heads, dim, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    scale = dim**-0.5

    for pool in (pool16, pool16.to(torch.float8_e4m3fn)):

        def all_layers(pool: torch.Tensor = pool) -> None:
            for layer in range(LAYERS):
                ops.paged_decode_attention(
                    q, pool[:, layer, 0], pool[:, layer, 1], tables, seq_lens, scale
                )

        def one_layer(pool: torch.Tensor = pool) -> None:
            ops.paged_decode_attention(q, pool[:, 0, 0], pool[:, 0, 1], tables, seq_lens, scale)

        from_memory = per_call(all_layers, 20) / LAYERS
        in_cache = per_call(one_layer, 300)
        print(
            f"attention: 16 requests at context 130-250, 9 query / 3 KV heads, {pool.dtype} "
            f"cache: {from_memory * 1e6:.1f} us per layer from memory, {in_cache * 1e6:.1f} us "
            "in cache"
        )


def bench_prompt_attention() -> None:
    fp8 = torch.float8_e4m3fn
    for label, cached, new, reqs, window, softcap, kv_dtype in (
        ("16 x 128 fresh", 0, 128, 16, 0, 0.0, None),
        ("512 after 1536", 1536, 512, 1, 0, 0.0, None),
        ("512 after 1536", 1536, 512, 1, 256, 0.0, None),
        ("512 after 1536", 1536, 512, 1, 0, 50.0, None),
        ("512 after 1536", 1536, 512, 1, 0, 0.0, fp8),
    ):
        times = time_prompt_attention(cached, new, reqs, window, softcap, kv_dtype)
        options = f", window {window}" if window else ""
        options += f", softcap {softcap:g}" if softcap else ""
        options += f", {kv_dtype} cache" if kv_dtype else ""
        print(
            f"prompt attention, {label} tokens{options}, 9 query / 3 KV heads: reference "
            f"{times['torch'] * 1e3:.2f} ms, in place {times['cpu'] * 1e3:.2f} ms per layer"
        )


def time_prompt_attention(
    cached: int,
    new: int,
    reqs: int,
    window: int = 0,
    softcap: float = 0.0,
    kv_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Seconds per call of each backend's forward for ``reqs`` chunks of ``new`` tokens after
    ``cached`` cached ones (one layer, bf16, the default model's heads), with the attention
    options ``window`` and ``softcap``, over a cache of ``kv_dtype`` (None: bf16)."""
    from baton_kernels.attention import AttentionMetadata, KVCacheView, create_attention_backend

    gen = torch.Generator().manual_seed(0)
    block, kv_heads, heads, dim = 16, 3, 9, 64
    per_req = -(-(cached + new) // block)
    pool = torch.randn(reqs * per_req + 1, 2, block, kv_heads, dim, generator=gen)
    cache = KVCacheView(pool.to(kv_dtype or torch.bfloat16))
    tables = torch.arange(1, reqs * per_req + 1).view(reqs, per_req)
    pos = torch.arange(cached, cached + new)
    md = AttentionMetadata(
        num_reqs=reqs,
        num_decodes=0,
        num_tokens=reqs * new,
        query_start_loc=[i * new for i in range(reqs + 1)],
        seq_lens=[cached + new] * reqs,
        block_tables=tables,
        slot_block=tables.gather(1, (pos // block)[None, :].expand(reqs, -1)).reshape(-1),
        slot_offset=(pos % block).repeat(reqs),
        decode_bias=None,
        max_decode_blocks=0,
    )
    q = torch.randn(reqs * new, heads, dim, generator=gen).to(torch.bfloat16)
    kv = torch.randn(reqs * new, 2, kv_heads, dim, generator=gen).to(torch.bfloat16)
    times = {}
    for name in ("torch", "cpu"):
        backend = create_attention_backend(name, kv_dtype=kv_dtype)
        times[name] = per_call(
            lambda b=backend: b.forward(
                q, kv[:, 0], kv[:, 1], cache, md, dim**-0.5, window=window, softcap=softcap
            ),
            20,
        )
    return times


def bench_argmax() -> None:
    ops = load_cpu_ops()
    logits = torch.randn(16, 49152)
    torch_us = per_call(lambda: logits.argmax(dim=-1), 500) * 1e6
    line = f"argmax of 16 x 49152 float32: torch {torch_us:.0f} us"
    if ops is not None:
        line += f", C++ {per_call(lambda: ops.argmax_rows(logits), 500) * 1e6:.0f} us"
    print(line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,4,8,12,16,24,32,64,128,512,2048")
    args = p.parse_args()
    print(f"{torch.get_num_threads()} threads")
    bench_linear([int(r) for r in args.rows.split(",")])
    bench_attention()
    bench_prompt_attention()
    bench_argmax()
    return 0


if __name__ == "__main__":
    sys.exit(main())
