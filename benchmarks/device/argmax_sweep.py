"""The greedy argmax's launch on the GPU: logits per program (``fused_ops.ARGMAX_CHUNK``) and
warps per program (``ARGMAX_WARPS``), at the rows and vocabularies of issue 5's decode steps.

    python benchmarks/device/argmax_sweep.py

Graph-timed us per call (fresh logits of every shape, bf16, each variant's ids checked against
``torch.argmax``), and GB/s of the logits read. Qwen at 256 rows reads 77.8 MB of logits a
decode step: the twenty-ninth session's profile had the launch at 36 us (2.2 TB/s).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libs" / "kernels"))
from baton_kernels.triton import fused_ops

SHAPES = ((256, 151936), (64, 151936), (1, 151936), (1, 128256))
VARIANTS = [(4096, None)] + [
    (chunk, warps)
    for chunk in (2048, 4096, 8192, 16384, 32768)
    for warps in (4, 8, 16)
    if (chunk, warps) != (4096, 4)
]


def main() -> int:
    dev = torch.device("cuda")
    logits = {s: (torch.randn(*s, device=dev) * 3).to(torch.bfloat16) for s in SHAPES}
    ref = {s: x.argmax(dim=-1) for s, x in logits.items()}
    print("chunk warps | " + " | ".join(f"{r}x{v}: us (GB/s)" for r, v in SHAPES))
    best: dict[tuple[int, int], tuple[float, str]] = {}
    for chunk, warps in VARIANTS:
        fused_ops.ARGMAX_CHUNK, fused_ops.ARGMAX_WARPS = chunk, warps
        cells = []
        for shape, x in logits.items():
            if not fused_ops.argmax(x).equal(ref[shape]):
                cells.append("WRONG")
                continue
            us = float(triton.testing.do_bench_cudagraph(lambda x=x: fused_ops.argmax(x), rep=200))
            us *= 1e3
            cells.append(f"{us:7.2f} ({x.numel() * 2 / us / 1e3:5.0f})")
            name = f"{chunk}/{warps or 'default'}"
            if shape not in best or us < best[shape][0]:
                best[shape] = (us, name)
        print(f"{chunk:5} {warps or 'def':>5} | " + " | ".join(cells), flush=True)
    for shape, (us, name) in best.items():
        print(f"best at {shape[0]}x{shape[1]}: {name} {us:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
