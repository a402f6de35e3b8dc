"""Why ``silu_and_mul_linear`` is slow at Qwen's decode shape (a probe, issue 5): the same
launch at M=256, N=896, K=4864 (bf16) with its parts turned off one at a time, in CUDA graphs
over 11 input copies (bench_silu_linear_gpu.py's timing), against the unfused kernels.

    python benchmarks/device/silu_linear_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_silu_linear_gpu import EPS, graph_time_us

import baton_kernels.triton.common as common
from baton_kernels.triton.fused_ops import silu_and_mul
from baton_kernels.triton.silu_linear import SiluLinearConfig, silu_and_mul_linear

m, n, k = 256, 896, 4864
dev = torch.device("cuda")
sets = []
for _ in range(11):
    x = torch.randn(m, 2 * k, device=dev).to(torch.bfloat16)
    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    s = torch.randn(m, n, device=dev).to(torch.bfloat16)
    sets.append((x, w, s))


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    return graph_time_us([lambda a=a: fn(*a) for a in sets])


print(f"unfused: {timed(lambda x, w, s: s.addmm_(silu_and_mul(x, norm_of=s, eps=EPS), w.t())):.2f}")
print(f"cuBLAS GEMM alone: {timed(lambda x, w, s: torch.mm(x[:, :k], w.t())):.2f}")
for cfg in (SiluLinearConfig(32, 128, 128, 4, 8, 3), SiluLinearConfig(64, 128, 64, 4, 4, 3),
            SiluLinearConfig(64, 64, 64, 4, 4, 3)):  # fmt: skip
    row = []
    for name, kw, pdl in (
        ("norm+res", dict(norm_of=True, residual=True), True),
        ("no PDL", dict(norm_of=True, residual=True), False),
        ("res only", dict(residual=True), True),
        ("bare", {}, True),
        ("bare split 1", {"split": 1}, True),
    ):
        common.PDL = pdl
        c = cfg._replace(split_k=1) if kw.pop("split", None) else cfg

        def call(x, w, s, kw=kw, c=c):  # type: ignore[no-untyped-def]
            return silu_and_mul_linear(
                x, w, residual=s if kw.get("residual") else None,
                norm_of=s if kw.get("norm_of") else None, eps=EPS, config=c,
            )  # fmt: skip

        try:
            row.append(f"{name} {timed(call):7.2f}")
        except Exception as e:
            row.append(f"{name} {type(e).__name__}")
    common.PDL = True
    print(tuple(cfg), "; ".join(row), flush=True)
