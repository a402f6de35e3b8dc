# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""Bytes read into the GPU's L2 cache ahead of the loads that need them.

At batch 1 a decode layer streams its weights from device memory, but the memory is idle while
the attention runs: the rotary + K/V write and the decode kernel are bound by latency, not
bytes. A kernel launched early by programmatic dependent launch (``gemv`` with
``l2_prefetch``) can call ``prefetch_l2`` on its weights before it waits for the previous
kernel, so that they arrive during that kernel instead of after it.

``prefetch_l2`` issues Hopper's bulk L2 prefetches (``cp.async.bulk.prefetch.L2.global``: a
hint, fire and forget, nothing written). The instruction exists from sm_90 on, and Triton's
interpreter has no inline assembly: callers use it only where PDL is on (``common.pdl_launch``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptr, nbytes, LANES: tl.constexpr):
    """Prefetch ``nbytes`` bytes at ``ptr`` (a byte pointer; both multiples of 16) into L2,
    one bulk prefetch per lane, ``LANES`` the program's thread count (one lane a thread)."""
    chunk = (tl.cdiv(nbytes, LANES) + 15) // 16 * 16
    start = tl.arange(0, LANES).to(tl.int64) * chunk
    size = (tl.maximum(tl.minimum(nbytes - start, chunk), 0) // 16 * 16).to(tl.int32)
    # a lane whose chunk is empty (past the end) issues nothing
    tl.inline_asm_elementwise(
        "{ .reg .pred has; setp.gt.s32 has, $2, 0; "
        "@has cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptr + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
