"""cuBLAS's rate on Llama-3.1-8B's four projections (issue 5, Llama at 256): what a prompt step
(M = 8,192 or 16,384 tokens) and a 256-request decode step (M = 256) can get from ``F.linear``,
graph-timed, bf16. Each shape over enough weight copies that the L2 holds none between uses.

    python benchmarks/device/gemm_rates.py [--rows 256,8192,16384]

Prints per shape and M: us, TFLOP/s, GB/s of weight read; and the sum over a layer (x 32).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="256,8192,16384")
    args = p.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    print(f"{'M':>6} {'proj':8} {'us':>9} {'TFLOP/s':>8} {'GB/s':>6}")
    for m in map(int, args.rows.split(",")):
        total_us = total_flop = 0.0
        for name, (n, k) in SHAPES.items():
            copies = max(2, -(-200_000_000 // (n * k * 2)))
            weights = [torch.randn(n, k, device=dev).to(bf) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device=dev).to(bf)
            outs = [torch.empty(m, n, device=dev, dtype=bf) for _ in range(copies)]

            def run(weights: list[torch.Tensor] = weights, x: torch.Tensor = x,
                    outs: list[torch.Tensor] = outs) -> None:  # fmt: skip
                for w, o in zip(weights, outs, strict=True):
                    torch.matmul(x, w.t(), out=o)

            ref = F.linear(x[:4], weights[0])
            run()
            torch.cuda.synchronize()
            assert torch.allclose(outs[0][:4].float(), ref.float(), atol=0.05, rtol=0.05)
            us = triton.testing.do_bench_cudagraph(run, rep=200) * 1e3 / copies
            flop = 2.0 * m * n * k
            total_us += us
            total_flop += flop
            print(f"{m:6} {name:8} {us:9.1f} {flop / us / 1e6:8.0f} {n * k * 2 / us / 1e3:6.0f}",
                  flush=True)  # fmt: skip
            del weights, outs
            torch.cuda.empty_cache()
        print(f"{m:6} {'layer':8} {total_us:9.1f} {total_flop / total_us / 1e6:8.0f}   "
              f"x32 = {total_us * 32 / 1e3:.2f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
