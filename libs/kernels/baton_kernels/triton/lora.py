# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""LoRA adapters' deltas for a step whose tokens use different adapters (or none).

A projection with ``L`` adapter slots of ``W`` columns each keeps every slot's ``A`` below its
own weight: one GEMM ``y_ext = x @ [W_base; A_0; ...; A_{L-1}].T`` gives the base output
``y_ext[:, :out]`` and every slot's shrunk input ``h = y_ext[:, out:]`` (``[T, L * W]``).
``lora_expand`` then adds, for each token, only its own slot's columns of ``h`` times that
slot's ``B``: ``out[t] = y_ext[t, :out] + h[t, slot W] @ B[slot]``, the other slots' columns
masked in the kernel from each token's slot index (-1: the base model, nothing added).

So a projection costs one launch more than without adapters (instead of a shrink GEMM, a mask
multiply and an expand GEMM), the same launches whatever the mix of adapters (CUDA graphs hold
them), and no per-step mask tensors: the slot indices are all a step sets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels.triton.common import (
    SUPPORTED_DTYPES,
    cdiv,
    dot_precision,
    next_pow2,
    pdl_begin,
    pdl_launch,
    upcast_in_kernel,
)
from baton_kernels.triton.launch import launcher


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_ptr"])
def _lora_expand_kernel(
    y_ptr,  # [T, out_f + LW]: the base output, then every slot's shrunk input
    slot_ptr,  # [T] int64: each token's slot, -1 for none
    b_ptr,  # [LW, out_f]: every slot's B, transposed and stacked
    out_ptr,  # [T, out_f]
    num_tokens,
    out_f,
    s_y,
    s_b,
    s_o,
    LW: tl.constexpr,  # slots x columns a slot
    W: tl.constexpr,  # columns a slot
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,  # the interpreter: no 16-bit float math
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < num_tokens
    n_ok = n < out_f
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in tl.static_range(0, LW, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        c_ok = c < LW
        # only each token's own slot's columns are read; the rest count as zeros
        hit = t_ok[:, None] & c_ok[None, :] & (c[None, :] // W == slot[:, None])
        h = tl.load(y_ptr + t[:, None] * s_y + out_f + c[None, :], mask=hit, other=0.0)
        b = tl.load(
            b_ptr + c[:, None] * s_b + n[None, :], mask=c_ok[:, None] & n_ok[None, :], other=0.0
        )
        if UPCAST:
            h = h.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(h, b, input_precision=DOT_PREC)
    ok = t_ok[:, None] & n_ok[None, :]
    base = tl.load(y_ptr + t[:, None] * s_y + n[None, :], mask=ok, other=0.0)
    tl.store(out_ptr + t[:, None] * s_o + n[None, :], (base.to(tl.float32) + acc).to(base.dtype),
             mask=ok)  # fmt: skip


def lora_expand(
    y_ext: torch.Tensor,
    slots: torch.Tensor,
    b_t: torch.Tensor,
    width: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y_ext[:, :out_f] + (h * mask) @ b_t`` where ``h = y_ext[:, out_f:]`` (``[T, L *
    width]``, ``b_t`` ``[L * width, out_f]``) and ``mask[t, c]`` is 1 where column ``c``
    belongs to token ``t``'s slot (``c // width == slots[t]``; -1: no slot, the base output
    alone). Computed in float32 and rounded once to ``y_ext``'s dtype; into ``out``
    ``[T, out_f]`` when given."""
    if y_ext.dim() != 2 or b_t.dim() != 2 or y_ext.stride(1) != 1 or b_t.stride(1) != 1:
        raise ValueError("y_ext and b_t must be 2-D with dense rows")
    lw, out_f = b_t.shape
    num_tokens = y_ext.shape[0]
    if width < 1 or lw % width or y_ext.shape[1] != out_f + lw:
        raise ValueError(
            f"y_ext {tuple(y_ext.shape)} does not hold {out_f} outputs and the {lw} columns "
            f"of b_t {tuple(b_t.shape)} (slots of {width})"
        )
    if y_ext.dtype not in SUPPORTED_DTYPES or b_t.dtype != y_ext.dtype:
        raise ValueError(f"unsupported dtypes {y_ext.dtype}, {b_t.dtype}")
    if slots.shape != (num_tokens,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be [{num_tokens}] integers: {tuple(slots.shape)}")
    if out is None:
        out = torch.empty((num_tokens, out_f), dtype=y_ext.dtype, device=y_ext.device)
    elif tuple(out.shape) != (num_tokens, out_f) or out.dtype != y_ext.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_tokens}, {out_f}] {y_ext.dtype}, rows dense")
    if num_tokens == 0 or out_f == 0:
        return out
    block_t = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
    block_n = 64 if out_f <= 1024 else 128
    launcher(_lora_expand_kernel)(
        (cdiv(num_tokens, block_t), cdiv(out_f, block_n)),
        y_ext,
        slots,
        b_t,
        out,
        num_tokens,
        out_f,
        y_ext.stride(0),
        b_t.stride(0),
        out.stride(0),
        LW=lw,
        W=width,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_K=max(16, min(64, next_pow2(lw))),
        DOT_PREC=dot_precision(y_ext.dtype),
        UPCAST=upcast_in_kernel(y_ext),
        num_warps=4,
        **pdl_launch(y_ext.device),
    )
    return out


def ref_lora_expand(
    y_ext: torch.Tensor, slots: torch.Tensor, b_t: torch.Tensor, width: int
) -> torch.Tensor:
    lw, out_f = b_t.shape
    cols = torch.arange(lw, device=y_ext.device) // width
    mask = cols[None, :] == slots[:, None].long()
    h = y_ext[:, out_f:].float() * mask
    return (y_ext[:, :out_f].float() + h @ b_t.float()).to(y_ext.dtype)
