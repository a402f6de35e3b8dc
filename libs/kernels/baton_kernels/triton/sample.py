# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""One token per row drawn from its probabilities on the GPU, each row with its own seed.

The draw is the exponential race: the token with the largest ``p / q``, where each token's
``q = -log(u)`` is exponential noise, wins with probability ``p`` (its share of the row's
total). Here ``u`` is the Philox uniform of the row's seed and the token's id (``tl.rand``), made
in registers where it is used: nothing of the noise goes to memory. torch's way (``exponential_``
into a ``[B, V]`` tensor, a division, an argmax) reads and writes the vocabulary five times over,
and a row with a seed of its own needs a generator reseeded and a launch of its own: one launch a
row at 256 seeded requests.

Each program takes one slice of a row and keeps the slice's best ratio and its token; small
batches split their rows into more slices, so that they still fill the GPU. The row's token is
then the best of its slices' (torch's ``argmax`` and ``gather``, two small launches). No atomics:
the same seeds give the same tokens from run to run, and whatever else is in the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels.triton.common import cdiv
from baton_kernels.triton.launch import launcher

BLOCK = 1024  # tokens per loop iteration
TARGET_PROGRAMS = 512  # rows x slices: enough to fill an H100/H200


@triton.jit(do_not_specialize=["stride_row", "vocab_size", "chunk", "num_splits"])
def _race_kernel(
    probs_ptr,
    stride_row,
    seeds_ptr,
    best_ratio_ptr,
    best_token_ptr,
    vocab_size,
    chunk,
    num_splits,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    seed = tl.load(seeds_ptr + row)
    start = split * chunk
    best_ratio = tl.full((), -1.0, tl.float32)
    best_token = tl.full((), 0, tl.int32)
    for offset in range(start, start + chunk, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        p = tl.load(probs_ptr + row.to(tl.int64) * stride_row + cols, mask=mask, other=0.0)
        u = tl.rand(seed, cols)
        ratio = p / -tl.log(u)  # (u = 0: q is infinite, the ratio 0)
        # a row left without a valid distribution (NaN) still gets a token id: its first
        ratio = tl.where(mask & (ratio == ratio), ratio, -1.0)
        top = tl.max(ratio, axis=0)
        take = top > best_ratio
        best_token = tl.where(take, offset + tl.argmax(ratio, axis=0), best_token)
        best_ratio = tl.where(take, top, best_ratio)
    tl.store(best_ratio_ptr + row * num_splits + split, best_ratio)
    tl.store(best_token_ptr + row * num_splits + split, best_token)


@triton.jit(do_not_specialize=["vocab_size"])
def _uniforms_kernel(seeds_ptr, out_ptr, vocab_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row)
    mask = cols < vocab_size
    tl.store(out_ptr + row.to(tl.int64) * vocab_size + cols, tl.rand(seed, cols), mask=mask)


def _check(probs: torch.Tensor, seeds: torch.Tensor) -> None:
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.stride(1) != 1:
        raise ValueError(f"probs must be [B, V] float32, rows contiguous; got {probs.dtype} "
                         f"{tuple(probs.shape)} strides {probs.stride()}")  # fmt: skip
    if seeds.shape != (probs.size(0),) or seeds.dtype != torch.int64:
        raise ValueError(f"seeds must be int64 [{probs.size(0)}], got {seeds.dtype} "
                         f"{tuple(seeds.shape)}")  # fmt: skip
    if seeds.device != probs.device:
        raise ValueError(f"seeds are on {seeds.device}, probs on {probs.device}")


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s token (``[B]`` int64): the argmax of ``probs[i] / q``, ``q = -log(u)`` with
    ``u`` the Philox uniforms of ``seeds[i]`` and each token's id (``uniforms``). ``probs``:
    ``[B, V]`` float32, need not sum to 1; ``seeds``: ``[B]`` int64 on the same device."""
    _check(probs, seeds)
    num_rows, vocab_size = probs.shape
    splits = max(1, min(cdiv(TARGET_PROGRAMS, max(num_rows, 1)), cdiv(vocab_size, BLOCK)))
    chunk = cdiv(cdiv(vocab_size, splits), BLOCK) * BLOCK
    splits = cdiv(vocab_size, chunk)
    best_ratio = torch.empty((num_rows, splits), dtype=torch.float32, device=probs.device)
    best_token = torch.empty((num_rows, splits), dtype=torch.int32, device=probs.device)
    if num_rows:
        launcher(_race_kernel)(
            (num_rows, splits),
            probs,
            probs.stride(0),
            seeds,
            best_ratio,
            best_token,
            vocab_size,
            chunk,
            splits,
            BLOCK=BLOCK,
            num_warps=4,
        )
    if splits == 1:
        return best_token.view(-1).long()
    # the first slice with the best ratio: the lowest token among ties, as torch's argmax
    best = best_ratio.argmax(dim=1, keepdim=True)
    return best_token.gather(1, best).squeeze(1).long()


def uniforms(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The ``[B, V]`` uniforms ``exponential_race`` draws from: ``tl.rand`` of each row's seed
    and each token's id."""
    out = torch.empty((seeds.shape[0], vocab_size), dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _uniforms_kernel[(seeds.shape[0], cdiv(vocab_size, BLOCK))](
            seeds, out, vocab_size, BLOCK=BLOCK
        )
    return out


def ref_exponential_race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """``exponential_race`` in PyTorch, from the same uniforms."""
    _check(probs, seeds)
    ratio = probs / -uniforms(seeds, probs.size(1)).log()
    ratio = torch.where(ratio.isnan(), -1.0, ratio)
    return ratio.argmax(dim=1)
