"""Fifty-fifth session: the few-row FP8 product (a batch-1 decode step's projections) on the GPU.

For Llama-3.1-8B's and Qwen2.5-0.5B's four projections at 1 and 4 rows, the time of one product
(in CUDA graphs, the weights rotated through copies that exceed L2, so each call reads its
weight from memory)
and its weight bytes per second, for: bf16 cuBLAS (``F.linear``, the bf16 weight), FP8
``_scaled_mm`` (row-wise, fast accumulation), the CUDA-core FP8 GEMV, and the tensor-core FP8
GEMV at several launches (each checked against the dequantized product first). Prints a table
and, on its last line, the tensor-core launch with the least total time over Llama's four
projections at 1 row (``BEST (n, k, warps, stages)``).

    python benchmarks/device/fp8gemv55.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from baton_kernels.fp8_linear import FAST_ACCUM, ref_quantize_rows
from baton_kernels.triton.quant import fp8_gemv

SHAPES = {
    "llama": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)},
    "qwen": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)},
}  # fmt: skip
DOTS = [(16, 256, 4, 3), (16, 512, 4, 3), (16, 512, 4, 4), (16, 1024, 4, 3), (16, 1024, 4, 4),
        (16, 2048, 4, 2), (32, 512, 4, 3), (32, 1024, 4, 3), (64, 256, 4, 4), (16, 512, 8, 4),
        (16, 1024, 8, 3)]  # fmt: skip
L2_BYTES = 200 << 20  # (more than an H100's or H200's L2)


def timed(fn: Callable[[int], torch.Tensor], calls: int) -> float:
    """Microseconds a call: ``calls`` calls captured in one CUDA graph (as the engine's steps
    run them: without the host's launch cost, which a Python loop of launches would time
    instead for kernels this short), replayed 10 times after a warm-up."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (10 * calls)


def product_variants(
    x: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    w: list[torch.Tensor],
    q8: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, tuple[Callable[[int], torch.Tensor], int]]:
    """Each variant's call ``fn(i)`` (the product with weight copy ``i``) and its weight's
    bytes an element."""
    copies = len(w)

    def scaled_mm(i: int) -> torch.Tensor:
        w8, ws = q8[i % copies]
        return torch._scaled_mm(q, w8.t(), scale_a=s[:, None], scale_b=ws[None, :],
                                out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip

    def gemv(dot: tuple[int, int, int, int] | None) -> Callable[[int], torch.Tensor]:
        return lambda i: fp8_gemv(q, s, *q8[i % copies], None, torch.bfloat16, dot)

    variants = {
        "bf16 cuBLAS": (lambda i: F.linear(x, w[i % copies]), 2),
        "fp8 _scaled_mm": (scaled_mm, 1),
        "fp8 cores": (gemv(None), 1),
    }
    for dot in DOTS:
        variants[f"fp8 dot {dot}"] = (gemv(dot), 1)
    return variants


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "FAST_ACCUM", FAST_ACCUM)
    totals: dict[str, float] = {}
    rows_out = []
    for shape, projections in SHAPES.items():
        for name, (n, k) in projections.items():
            copies = max(2, -(-L2_BYTES // (n * k)))
            w = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            q8 = [ref_quantize_rows(t) for t in w]
            for m in (1, 4):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                q, s = ref_quantize_rows(x)
                want = (q.float() * s[:, None]) @ (q8[0][0].float() * q8[0][1][:, None]).t()
                variants = product_variants(x, q, s, w, q8)
                for label, (fn, elem) in variants.items():
                    got = fn(0).float()
                    if label != "bf16 cuBLAS":
                        err = (got - want).abs().max().item() / want.abs().max().item()
                        if err > 2e-2:
                            print(f"WRONG {shape} {name} m={m} {label}: rel err {err:.3g}")
                            continue
                    us = timed(fn, min(200, max(50, copies)))
                    gbs = n * k * elem / us / 1e3
                    rows_out.append((shape, name, m, label, us, gbs))
                    if shape == "llama" and m == 1:
                        totals[label] = totals.get(label, 0.0) + us
            del w, q8
            torch.cuda.empty_cache()
    print(f"{'shape':6} {'proj':8} {'M':>2} {'variant':28} {'us':>8} {'GB/s':>7}")
    for shape, name, m, label, us, gbs in rows_out:
        print(f"{shape:6} {name:8} {m:2} {label:28} {us:8.1f} {gbs:7.0f}")
    print("llama M=1, the four projections (us):")
    for label, us in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"  {label:28} {us:8.1f}")
    dots = {label: us for label, us in totals.items() if label.startswith("fp8 dot")}
    best = min(dots, key=dots.__getitem__)
    print("BEST", best.removeprefix("fp8 dot ").replace(" ", ""))


if __name__ == "__main__":
    main()
