"""Whether Baton's Triton launch cache is on for the prompt step's kernels on this machine, and
why not where it is off (``Launcher.off_because``); Triton's launch hooks.

    python benchmarks/device/launch_state.py
"""

from __future__ import annotations

import torch
from triton import knobs

from baton_kernels.triton import fused_ops, launch


def main() -> int:
    x = torch.randn(37, 2 * 896, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        fused_ops.silu_and_mul(x)
        fused_ops.argmax(logits)
    print("hooks:", knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    for kernel in (fused_ops._silu_and_mul_kernel, fused_ops._argmax_kernel):
        state = launch.launcher(kernel)
        print(f"{kernel.__name__}: on {state.enabled}, {len(state._compiled)} kept, "
              f"off because {state.off_because!r}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
