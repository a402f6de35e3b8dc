# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""Each row's top-p (nucleus) cut on the GPU, without sorting the vocabulary.

Sorting every row, torch's way, took 4.2 ms for 256 rows of Qwen's 151,936 logits on an H200
(``benchmarks/bench_sampler.py --device cuda``): twice the model's whole decode step.
``top_p_threshold`` searches for the cut instead. The cut is the largest logit ``t`` such that
the tokens at or above ``t`` hold at least ``p`` of the row's probability mass; keeping the
logits ``>= t`` keeps the smallest set of most likely tokens that reaches ``p``.

The search narrows an interval known to hold the cut, ``PASSES`` times. Each pass is one launch
over every row, split into slices so that small batches still fill the GPU: a program measures
the mass (``exp(x - max)``) of its slice at or above ``NUM_PIVOTS`` evenly spaced candidates
inside the row's interval, and writes these partial sums. The next pass's programs add them up
for their row and keep the gap between the last candidate that still reaches ``p`` of the total
and the next: ``NUM_PIVOTS + 1`` times narrower each pass. No atomics, so the result is the
same from run to run, and nothing waits for the device.

The interval starts as ``[max - SPAN, max]``: tokens further below the max hold under
``e^-SPAN`` of the mass each, and no p below 1 in float32 reaches them. After the passes it is
``SPAN / (NUM_PIVOTS + 1) ** PASSES`` wide (1e-8 of a logit with the defaults), and its lower end
is the threshold: tokens within that distance below the exact cut, ties in effect, are kept too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels.triton.common import cdiv
from baton_kernels.triton.launch import launcher

SPAN = 80.0  # logits below the row's max by more than this are never in a nucleus (p < 1)
NUM_PIVOTS = 16  # a power of two (tl.arange)
PASSES = 8
BLOCK = 256  # logits per loop iteration (x NUM_PIVOTS sums held in registers)
TARGET_PROGRAMS = 1024  # rows x slices per pass: enough to fill an H100/H200


@triton.jit
def _narrowed(
    mass_ptr,
    total_ptr,
    top_p,
    row,
    num_rows,
    num_splits,
    num_passes,
    lo,
    width,
    NUM_PIVOTS: tl.constexpr,
):
    """The row's interval after the first ``num_passes`` passes, from their partial sums."""
    j = tl.arange(0, NUM_PIVOTS)
    if num_passes > 0:
        total = tl.zeros((), tl.float32)
        for s in range(num_splits):
            total += tl.load(total_ptr + row * num_splits + s)
        target = top_p * total
        for q in range(num_passes):
            mass = tl.zeros((NUM_PIVOTS,), tl.float32)
            for s in range(num_splits):
                part = ((q * num_rows + row) * num_splits + s) * NUM_PIVOTS
                mass += tl.load(mass_ptr + part + j)
            # the mass falls as the pivot rises: the first k pivots still reach the target
            k = tl.sum((mass >= target).to(tl.int32), 0)
            width = width / (NUM_PIVOTS + 1)
            lo = lo + width * k.to(tl.float32)
    return lo, width


# The row count, the slices and the pass change from call to call: one compiled variant for all.
@triton.jit(do_not_specialize=["stride_row", "chunk", "num_rows", "num_splits", "pass_idx"])
def _top_p_pass_kernel(
    logits_ptr,
    stride_row,
    vocab_size,
    chunk,  # logits per slice (a multiple of BLOCK)
    max_ptr,
    top_p_ptr,
    mass_ptr,  # [PASSES, rows, slices, NUM_PIVOTS] float32
    total_ptr,  # [rows, slices] float32
    out_ptr,  # [rows] float32, written by the final launch
    num_rows,
    num_splits,
    pass_idx,
    SPAN: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    FINAL: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    m = tl.load(max_ptr + row)
    lo, width = _narrowed(
        mass_ptr,
        total_ptr,
        tl.load(top_p_ptr + row),
        row,
        num_rows,
        num_splits,
        pass_idx,
        m - SPAN,
        tl.full((), SPAN, tl.float32),
        NUM_PIVOTS,
    )
    if FINAL:
        tl.store(out_ptr + row, lo)
    else:
        step = width / (NUM_PIVOTS + 1)
        pivots = lo + step * (tl.arange(0, NUM_PIVOTS) + 1).to(tl.float32)
        base = logits_ptr + row.to(tl.int64) * stride_row
        offs = tl.arange(0, BLOCK)
        first = split * chunk
        # Sums per lane and pivot, reduced across the block once at the end: a reduction per
        # iteration (across threads) made the pass ~10x slower than its reads.
        mass = tl.zeros((BLOCK, NUM_PIVOTS), tl.float32)
        total = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, chunk, BLOCK):
            idx = first + start + offs
            x = tl.load(base + idx, mask=idx < vocab_size, other=float("-inf"))
            e = tl.exp(x - m)
            total += e
            mass += tl.where(x[:, None] >= pivots[None, :], e[:, None], 0.0)
        part = ((pass_idx * num_rows + row) * num_splits + split) * NUM_PIVOTS
        tl.store(mass_ptr + part + tl.arange(0, NUM_PIVOTS), tl.sum(mass, 0))
        if pass_idx == 0:
            tl.store(total_ptr + row * num_splits + split, tl.sum(total, 0))


def top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of float32 ``logits`` ``[B, V]``, the logit at and above which the tokens hold at
    least ``top_p`` (``[B]``) of the row's mass: ``-inf`` where ``top_p >= 1``. Keeping the
    logits at or above it keeps the nucleus (and always the most likely token)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            f"expected [B, V] float32 logits with unit column stride, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    rows, vocab_size = logits.shape
    if top_p.shape != (rows,):
        raise ValueError(f"top_p must be [{rows}], got {tuple(top_p.shape)}")
    device = logits.device
    top_p = top_p.to(device=device, dtype=torch.float32).contiguous()
    out = torch.empty(rows, dtype=torch.float32, device=device)
    if rows and vocab_size:
        splits = max(1, min(cdiv(TARGET_PROGRAMS, rows), cdiv(vocab_size, BLOCK)))
        chunk = cdiv(cdiv(vocab_size, splits), BLOCK) * BLOCK
        splits = cdiv(vocab_size, chunk)
        row_max = logits.amax(dim=1)
        mass = torch.empty(PASSES * rows * splits * NUM_PIVOTS, dtype=torch.float32, device=device)
        total = torch.empty(rows * splits, dtype=torch.float32, device=device)
        for pass_idx in range(PASSES + 1):
            final = pass_idx == PASSES
            launcher(_top_p_pass_kernel)(
                (rows, 1 if final else splits),
                logits,
                logits.stride(0),
                vocab_size,
                chunk,
                row_max,
                top_p,
                mass,
                total,
                out,
                rows,
                splits,
                pass_idx,
                SPAN=SPAN,
                NUM_PIVOTS=NUM_PIVOTS,
                BLOCK=BLOCK,
                FINAL=final,
                num_warps=4,
            )
    return out.masked_fill_(top_p >= 1.0, float("-inf"))


def ref_top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The exact cut, by sorting each row in float64: the smallest logit whose mass strictly
    above is below ``p`` (``-inf`` where ``p >= 1``)."""
    values = logits.double().sort(dim=1, descending=True).values
    probs = values.softmax(dim=1)
    above = probs.cumsum(dim=1) - probs
    kept = (above < top_p.double().unsqueeze(1)).sum(dim=1).clamp(min=1)
    cut = values.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
    return cut.float().masked_fill(top_p >= 1.0, float("-inf"))
