"""Fifty-fifth session: where the FP8 layers' GPU runs differ from their references.
1. The Triton quantization kernel against torch's (the unit test's inputs): rows whose scale
   differs (in ulps), elements whose FP8 value differs (in steps).
2. The engine's greedy tokens with FP8 layers (the GPU test's workload, float32): the eager
   torch reference against the Triton backend eager and with graphs: requests whose first
   token differs, and the mean length of the equal prefix."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, "tests/gpu")
from baton_kernels.fp8_linear import ref_quantize_rows
from baton_kernels.triton.quant import quantize_rows

for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for cols in (64, 100, 5000):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, cols, generator=g).to(dtype).cuda()
        x[1] *= 1000.0
        x[2] = 0.0
        q, s = quantize_rows(x)
        rq, rs = ref_quantize_rows(x)
        ulps = (s.view(torch.int32) - rs.view(torch.int32)).abs()
        steps = (q.view(torch.uint8).int() - rq.view(torch.uint8).int()).abs()
        print(
            f"{dtype!s:15} {cols:5}  scale ulps max {int(ulps.max())}  "
            f"q diffs {int((steps > 0).sum())} (max {int(steps.max())})  "
            f"inf {bool(torch.isinf(x).any())}"
        )

import test_engine_gpu as t  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    d = Path(tmp)
    (d / "config.json").write_text(json.dumps(t.CONFIG))
    want, ref = t._run(d, "torch", enforce_eager=True, async_scheduling=False, quantization="fp8")
    del ref
    t._release_memory()
    for name, kw in (
        ("triton eager", dict(enforce_eager=True, async_scheduling=False)),
        ("triton graphs", dict(enforce_eager=False)),
    ):
        got, core = t._run(d, "triton", quantization="fp8", **kw)
        del core
        t._release_memory()
        first = sum(got[r][0] != want[r][0] for r in want)
        same = [
            next(
                (i for i, (a, b) in enumerate(zip(got[r], want[r], strict=True)) if a != b),
                len(want[r]),
            )
            for r in want
        ]
        print(
            f"{name}: first tokens differ in {first} of {len(want)}; equal prefix "
            f"{sum(same) / len(same):.1f} of 24: {same}"
        )
