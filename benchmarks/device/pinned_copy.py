"""What level 1 of sleep mode spends its time on: copying N GiB of device memory to host memory
that is page-locked (allocated for the copy, as ``ModelRunner.sleep`` does; or allocated
before), or pageable; and back. Prints seconds per phase.

    python3 benchmarks/device/pinned_copy.py [GiB]
"""

import sys
import time

import torch

n = int(float(sys.argv[1] if len(sys.argv) > 1 else 15) * 2**30)
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
dev.fill_(1)
torch.cuda.synchronize()


def timed(what, fn):
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    print(f"{what:<40} {time.perf_counter() - start:7.3f} s")
    return out


def both_ways(host: torch.Tensor, kind: str) -> None:
    timed(f"copy to {kind} (first touch)", lambda: host.copy_(dev, non_blocking=True))
    timed(f"copy to {kind} again", lambda: host.copy_(dev, non_blocking=True))
    timed(f"copy back from {kind}", lambda: dev.copy_(host, non_blocking=True))


both_ways(timed("allocate page-locked", lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True)),
          "page-locked")  # fmt: skip
both_ways(timed("allocate pageable", lambda: torch.empty(n, dtype=torch.uint8)), "pageable")
