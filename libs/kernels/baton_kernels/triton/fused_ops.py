# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""Fused elementwise kernels for the Llama decoder, each replacing a chain of small torch kernels.

- ``rotary_embedding_``: rotate q and k in place (Hugging Face's rotate-half layout), one launch
  for both, reading cos/sin straight from the ``[max_positions, 2, head_dim]`` table at each
  token's position (instead of index, cast, cat, neg, mul, mul, add for each of q and k).
- ``silu_and_mul``: ``silu(gate) * up`` of the fused gate/up projection output.
- ``fused_add_rms_norm``: ``residual += x`` then RMSNorm of the sum (and ``rms_norm`` alone).
- ``argmax``: each row's argmax over the vocabulary, the rows cut into chunks across programs.

All math is in float32 with one rounding to the tensors' dtype at the end; the results agree with
the torch code paths within a rounding of the output (those round some intermediates to the dtype
too). Tensors are read through their strides, so the q/k views split from a fused projection are
rotated where they lie. The token count sets the grid, and where a kernel also takes it (the
rotary's last program masks the tokens past it) it is not specialized on: no integer argument that
changes from step to step selects a variant, so a new batch size never compiles one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels.attention.base import cache_max
from baton_kernels.triton.common import (
    SUPPORTED_DTYPES,
    cache_value,
    cdiv,
    next_pow2,
    pdl_begin,
    pdl_launch,
    zeroed_counters,
)
from baton_kernels.triton.kv_write import check_cache_dtype
from baton_kernels.triton.launch import launcher

POSITION_DTYPES = (torch.int32, torch.int64)
SILU_BLOCK = 1024  # columns of the output per program in silu_and_mul
# silu_and_mul(norm_of=) of at least this many rows runs one program a row, looping over its
# columns blocks (prompt steps with the norms folded, LlamaForCausalLM.fold_norms)
SILU_ROW_LOOP_MIN_ROWS = 1024
ROPE_MAX_ELEMS = 8192  # tokens x heads x head_dim per rotary program
# Tokens per rotary program (None: as many as ROPE_MAX_ELEMS allows). One program per token and
# head block moved 2 KB or less each: on an H200 the launch took 41.0 us at 16,384 tokens of
# Qwen2.5-0.5B's heads, 24.1 us with 8 tokens a program, and 137.1 against 127.9 us with 2 of
# Llama-3.1-8B's (benchmarks/bench_rotary_gpu.py).
ROPE_TOKENS: int | None = None


def _num_warps(block: int) -> int:
    return 4 if block >= 1024 else 2 if block >= 256 else 1


def _check_out(out: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor, what: str) -> None:
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"{what}: out is {tuple(out.shape)} {out.dtype} on {out.device}, expected "
            f"{shape} {like.dtype} on {like.device}"
        )


# --------------------------------------------------------------------------------------------
# rotary embedding


@triton.jit
def _normed(x, rstd, bias_ptr, offs_h, cols, mask, HALF: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A ``[BLOCK_T, BLOCK_H, BLOCK_HALF]`` tile of a folded projection's output times each
    token's 1/rms, plus the bias of its head and columns, rounded to ``x``'s dtype as the
    unfolded projection's output is (``decode_attention._normed``, per token)."""
    y = x.to(tl.float32) * rstd[:, None, None]
    if HAS_BIAS:
        b = bias_ptr + offs_h[None, :, None] * (2 * HALF) + cols[None, None, :]
        y += tl.load(b, mask=mask, other=0.0).to(tl.float32)
    return y.to(x.dtype)


@triton.jit
def _row_rstd(x_ptr, t, t_ok, s_t, hidden, eps, BLOCK_HID: tl.constexpr):
    """``[BLOCK_T]`` fp32: 1/rms of rows ``t`` of ``x`` (``hidden`` dense values each)."""
    offs = tl.arange(0, BLOCK_HID)
    ok = t_ok[:, None] & (offs < hidden)[None, :]
    xs = tl.load(x_ptr + t[:, None] * s_t + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(xs * xs, axis=1) / hidden + eps)


@triton.jit
def _rotate_heads(
    x_ptr,
    t,  # [BLOCK_T] the program's tokens
    t_ok,  # [BLOCK_T] which of them exist
    head_block,
    num_heads,
    s_t,
    s_h,
    s_d,
    cos1,  # [BLOCK_T, 1, BLOCK_HALF] fp32, first half of cos
    cos2,
    sin1,
    sin2,
    offs_d,  # [BLOCK_HALF]
    rstd,  # NORM: [BLOCK_T] fp32, each token's 1/rms
    bias_ptr,  # HAS_BIAS: these heads' bias rows [num_heads, 2 * HALF]
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (
        t_ok[:, None, None] & (offs_h < num_heads)[None, :, None] & (offs_d < HALF)[None, None, :]
    )
    p1 = x_ptr + t[:, None, None] * s_t + offs_h[None, :, None] * s_h + offs_d[None, None, :] * s_d
    p2 = p1 + HALF * s_d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    if NORM:
        x1 = _normed(x1, rstd, bias_ptr, offs_h, offs_d, mask, HALF, HAS_BIAS)
        x2 = _normed(x2, rstd, bias_ptr, offs_h, offs_d + HALF, mask, HALF, HAS_BIAS)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # rotate_half(x) = cat(-x2, x1):  out = x * cos + rotate_half(x) * sin
    o1 = (x1 * cos1 - x2 * sin1).to(dtype)
    o2 = (x2 * cos2 + x1 * sin2).to(dtype)
    tl.store(p1, o1, mask=mask)
    tl.store(p2, o2, mask=mask)
    return o1, o2, offs_h, mask


# position and slot tensors are often slices of persistent buffers
@triton.jit(
    do_not_specialize=["num_tokens"],
    do_not_specialize_on_alignment=["pos_ptr", "slot_block_ptr", "slot_offset_ptr"],
)
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_sin_ptr,
    num_tokens,
    num_q_heads,
    num_k_heads,
    s_qt,
    s_qh,
    s_qd,
    s_kt,
    s_kh,
    s_kd,
    s_cp,  # cos_sin strides: position, cos/sin, dim
    s_cc,
    s_cd,
    v_ptr,  # WRITE_KV: the new V rows, the cache and each token's slot (else unused)
    kv_ptr,
    slot_block_ptr,
    slot_offset_ptr,
    s_vt,
    s_vh,
    s_vd,
    s_kvb,  # cache strides: block, K/V, offset in block, head, dim
    s_kvkv,
    s_kvs,
    s_kvh,
    s_kvd,
    norm_ptr,  # NORM: the rows of the stream whose 1/rms scales q, k and v (else unused)
    s_nt,
    hidden,
    eps,
    bias_ptr,  # HAS_BIAS: [num_q_heads + 2 * num_k_heads, 2 * HALF], q then k then v
    k_inv,  # WRITE_KV: 1 / the layer's K and V scales (an 8-bit cache's)
    v_inv,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    WRITE_KV: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_HID: tl.constexpr,
    KV_MAX: tl.constexpr,  # WRITE_KV: cache_value's saturation (an 8-bit cache's)
    PDL: tl.constexpr,
):
    """Program (i, j): tokens ``i * BLOCK_T`` on, their query heads block j, or key heads
    block j - #query blocks. With ``WRITE_KV`` a key program also stores its rotated K rows and
    the tokens' V rows into the paged cache at each token's slot (skipped for a negative block:
    a padding token). With ``NORM`` q, k and v are a folded projection's output, multiplied by
    each token's 1/rms of its stream row and given the bias first (and q and k stored so)."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    j = tl.program_id(1)
    rstd = tl.full([BLOCK_T], 1.0, tl.float32)
    if NORM:
        rstd = _row_rstd(norm_ptr, t, t_ok, s_nt, hidden, eps, BLOCK_HID)
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    cs_ok = t_ok[:, None] & (offs_d < HALF)[None, :]
    row = cos_sin_ptr + pos[:, None] * s_cp + offs_d[None, :] * s_cd
    cos1 = tl.load(row, mask=cs_ok, other=0.0)
    cos2 = tl.load(row + HALF * s_cd, mask=cs_ok, other=0.0)
    sin1 = tl.load(row + s_cc, mask=cs_ok, other=0.0)
    sin2 = tl.load(row + s_cc + HALF * s_cd, mask=cs_ok, other=0.0)
    # rounded to the activations' dtype first, as the model's ``cos_sin[positions].to(dtype)``
    dtype = q_ptr.dtype.element_ty
    cos1 = cos1.to(dtype).to(tl.float32)[:, None, :]
    cos2 = cos2.to(dtype).to(tl.float32)[:, None, :]
    sin1 = sin1.to(dtype).to(tl.float32)[:, None, :]
    sin2 = sin2.to(dtype).to(tl.float32)[:, None, :]
    q_blocks = tl.cdiv(num_q_heads, BLOCK_HQ)
    if j < q_blocks:
        _rotate_heads(
            q_ptr, t, t_ok, j, num_q_heads, s_qt, s_qh, s_qd, cos1, cos2, sin1, sin2, offs_d,
            rstd, bias_ptr, HALF, BLOCK_HQ, BLOCK_HALF, NORM, HAS_BIAS,
        )  # fmt: skip
    else:
        k_bias = bias_ptr + num_q_heads * 2 * HALF
        k1, k2, offs_h, mask = _rotate_heads(
            k_ptr, t, t_ok, j - q_blocks, num_k_heads, s_kt, s_kh, s_kd, cos1, cos2, sin1, sin2,
            offs_d, rstd, k_bias, HALF, BLOCK_HK, BLOCK_HALF, NORM, HAS_BIAS,
        )  # fmt: skip
        if WRITE_KV:
            block = tl.load(slot_block_ptr + t, mask=t_ok, other=-1).to(tl.int64)
            offset = tl.load(slot_offset_ptr + t, mask=t_ok, other=0).to(tl.int64)
            mask = mask & (block >= 0)[:, None, None]
            dst = (
                kv_ptr + block[:, None, None] * s_kvb + offset[:, None, None] * s_kvs
                + offs_h[None, :, None] * s_kvh + offs_d[None, None, :] * s_kvd
            )  # fmt: skip
            tl.store(dst, cache_value(k1, kv_ptr, k_inv, KV_MAX), mask=mask)
            tl.store(dst + HALF * s_kvd, cache_value(k2, kv_ptr, k_inv, KV_MAX), mask=mask)
            src = (
                v_ptr + t[:, None, None] * s_vt + offs_h[None, :, None] * s_vh
                + offs_d[None, None, :] * s_vd
            )  # fmt: skip
            v1 = tl.load(src, mask=mask)
            v2 = tl.load(src + HALF * s_vd, mask=mask)
            if NORM:
                v_bias = k_bias + num_k_heads * 2 * HALF
                v1 = _normed(v1, rstd, v_bias, offs_h, offs_d, mask, HALF, HAS_BIAS)
                v2 = _normed(v2, rstd, v_bias, offs_h, offs_d + HALF, mask, HALF, HAS_BIAS)
            tl.store(dst + s_kvkv, cache_value(v1, kv_ptr, v_inv, KV_MAX), mask=mask)
            tl.store(dst + s_kvkv + HALF * s_kvd, cache_value(v2, kv_ptr, v_inv, KV_MAX), mask=mask)


def _check_rotary(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(
            f"query and key must be [tokens, heads, head_dim]: {tuple(query.shape)}, "
            f"{tuple(key.shape)}"
        )
    num_tokens, _, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even: {head_dim}")
    if query.dtype != key.dtype or query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"query/key dtypes {query.dtype}/{key.dtype}: expected one of fp16/bf16/fp32"
        )
    if positions.shape != (num_tokens,) or positions.dtype not in POSITION_DTYPES:
        raise ValueError(
            f"positions must be [{num_tokens}] int32/int64: {tuple(positions.shape)} "
            f"{positions.dtype}"
        )
    if cos_sin.dim() != 3 or cos_sin.shape[1] != 2 or cos_sin.shape[2] != head_dim:
        raise ValueError(f"cos_sin must be [max_positions, 2, {head_dim}]: {tuple(cos_sin.shape)}")
    if cos_sin.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported cos_sin dtype {cos_sin.dtype}")
    devices = {query.device, key.device, positions.device, cos_sin.device}
    if len(devices) != 1:
        raise ValueError(f"query, key, positions and cos_sin are on different devices: {devices}")


def rotary_embedding_(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], any strides; rotated in place
    key: torch.Tensor,  # [num_tokens, num_k_heads, head_dim], any strides; rotated in place
    positions: torch.Tensor,  # [num_tokens] int32/int64
    cos_sin: torch.Tensor,  # [max_positions, 2, head_dim] (cos then sin), usually float32
) -> None:
    """Rotate ``query`` and ``key`` in place by each token's position, as ``RopeTables.apply``
    does with tables ``cos_sin[positions].to(query.dtype)``. Positions are not bounds-checked."""
    _check_rotary(query, key, positions, cos_sin)
    _launch_rotary(query, key, positions, cos_sin, None)


def rotary_embedding_and_write_kv_(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,  # [num_tokens, num_k_heads, head_dim], any strides
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv: torch.Tensor,  # one layer's cache [num_blocks, 2, block_size, num_k_heads, head_dim]
    slot_block: torch.Tensor,  # [num_tokens] int: block id, < 0 to skip the token
    slot_offset: torch.Tensor,  # [num_tokens] int: offset inside that block
    *,
    norm_of: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``rotary_embedding_`` and then ``kv_write.write_kv_cache`` of the rotated keys and the
    values, in one launch: a decode step of a small model is bound by its kernel count.
    ``k_scale`` / ``v_scale``: the layer's (``KVCacheView``'s), for an 8-bit cache.

    With ``norm_of`` ``[num_tokens, hidden]`` (its rows dense), q, k and v are the output of a
    projection with an RMSNorm's weight folded in (``LlamaForCausalLM.fold_norms``), taken
    without its ``bias`` (``[num_q_heads + 2 * num_k_heads, head_dim]``, contiguous, or None):
    each token's q, k and v are first multiplied by ``1 / rms(norm_of[t])`` (``eps`` inside
    the root), given the bias and rounded to their dtype, the norm before the projection
    without its own kernel; q and k are stored so, rotated."""
    _check_rotary(query, key, positions, cos_sin)
    num_tokens, num_k_heads, head_dim = key.shape
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value {tuple(value.shape)} {value.dtype} does not match key")
    if kv.dim() != 5 or kv.shape[1] != 2 or tuple(kv.shape[3:]) != (num_k_heads, head_dim):
        raise ValueError(f"cache must be [blocks, 2, block_size, {num_k_heads}, {head_dim}]")
    check_cache_dtype(kv.dtype, key.dtype)
    if slot_block.shape != (num_tokens,) or slot_offset.shape != (num_tokens,):
        raise ValueError(f"slot_block and slot_offset must be [{num_tokens}]")
    norm = None
    if norm_of is not None:
        if norm_of.dim() != 2 or norm_of.shape[0] != num_tokens or norm_of.stride(1) != 1:
            raise ValueError(f"norm_of must be [{num_tokens}, hidden], its rows dense")
        heads = query.shape[1] + 2 * num_k_heads
        if bias is not None and (
            tuple(bias.shape) != (heads, head_dim) or not bias.is_contiguous()
        ):
            raise ValueError(f"bias must be a contiguous [{heads}, {head_dim}]")
        norm = (norm_of, eps, bias)
    elif bias is not None:
        raise ValueError("a bias is applied only with norm_of (a folded projection's q/k/v)")
    write = (value, kv, slot_block, slot_offset, k_scale, v_scale)
    _launch_rotary(query, key, positions, cos_sin, write, norm)


def _launch_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None,
    norm: tuple[torch.Tensor, float, torch.Tensor | None] | None = None,
) -> None:
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_half = next_pow2(half)
    cap = max(1, ROPE_MAX_ELEMS // (2 * block_half))
    block_hq = min(next_pow2(num_q_heads), cap)
    block_hk = min(next_pow2(num_k_heads), cap)
    per_token = 2 * block_half * max(block_hq, block_hk)
    block_t = ROPE_TOKENS or max(1, ROPE_MAX_ELEMS // per_token)
    grid = (cdiv(num_tokens, block_t), cdiv(num_q_heads, block_hq) + cdiv(num_k_heads, block_hk))
    pdl = pdl_launch(query.device)
    v_strides: tuple[int, ...]
    kv_strides: tuple[int, ...]
    if write is None:  # unused pointers, strides and scales
        value, kv, slot_block, slot_offset = key, key, positions, positions
        k_scale = v_scale = 1.0
        v_strides, kv_strides = (0, 0, 0), (0, 0, 0, 0, 0)
    else:
        value, kv, slot_block, slot_offset, k_scale, v_scale = write
        v_strides, kv_strides = value.stride(), kv.stride()
    norm_of, eps, bias = norm if norm is not None else (query, 0.0, None)
    hidden = norm_of.shape[1] if norm is not None else 1
    launcher(_rotary_kernel)(
        grid,
        query,
        key,
        positions,
        cos_sin,
        num_tokens,
        num_q_heads,
        num_k_heads,
        *query.stride(),
        *key.stride(),
        *cos_sin.stride(),
        value,
        kv,
        slot_block,
        slot_offset,
        *v_strides,
        *kv_strides,
        norm_of,
        norm_of.stride(0),
        hidden,
        eps,
        bias if bias is not None else query,
        1.0 / k_scale,
        1.0 / v_scale,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_T=block_t,
        WRITE_KV=write is not None,
        NORM=norm is not None,
        HAS_BIAS=bias is not None,
        BLOCK_HID=next_pow2(hidden),
        KV_MAX=cache_max(kv.dtype) if write is not None else 0.0,
        num_warps=_num_warps(per_token * block_t),
        **pdl,
    )


def ref_rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of ``query`` and ``key`` (the model's torch code path)."""
    table = cos_sin[positions].to(query.dtype)  # [T, 2, D]
    cos, sin = table[:, 0].unsqueeze(1), table[:, 1].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    return rotate(query), rotate(key)


# --------------------------------------------------------------------------------------------
# silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,  # I: the output's width; gate is x[:, :I], up is x[:, I:]
    s_xt,
    s_xc,
    s_ot,
    s_oc,
    norm_ptr,  # NORM: the rows whose 1/rms scales gate and up (silu_and_mul's norm_of)
    s_nt,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_HID: tl.constexpr,
    ROW_LOOP: tl.constexpr,
    PDL: tl.constexpr,
    GELU: tl.constexpr = False,
):
    """Program (t, j): row t's output columns block j; with ``ROW_LOOP`` program t does every
    block of row t in turn (its 1/rms computed once). ``GELU``: GELU's tanh form in place of
    SiLU (``gelu_tanh_and_mul``)."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    rstd = 1.0
    if NORM:
        offs_x = tl.arange(0, BLOCK_HID)
        xs = tl.load(norm_ptr + t * s_nt + offs_x, mask=offs_x < hidden, other=0.0)
        xs = xs.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xs * xs, axis=0) / hidden + eps)
    if ROW_LOOP:
        for start in range(0, inter, BLOCK):
            _silu_and_mul_block(x_ptr, out_ptr, t, start + tl.arange(0, BLOCK), inter, s_xt,
                                s_xc, s_ot, s_oc, rstd, NORM, GELU)  # fmt: skip
    else:
        _silu_and_mul_block(x_ptr, out_ptr, t, tl.program_id(1) * BLOCK + tl.arange(0, BLOCK),
                            inter, s_xt, s_xc, s_ot, s_oc, rstd, NORM, GELU)  # fmt: skip


@triton.jit
def _silu_and_mul_block(
    x_ptr, out_ptr, t, offs, inter, s_xt, s_xc, s_ot, s_oc, rstd, NORM: tl.constexpr,
    GELU: tl.constexpr,
):  # fmt: skip
    mask = offs < inter
    gate_ptrs = x_ptr + t * s_xt + offs * s_xc
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + inter * s_xc, mask=mask, other=0.0)
    if NORM:  # rounded as the unfolded projection's output is
        gate = (gate.to(tl.float32) * rstd).to(gate.dtype)
        up = (up.to(tl.float32) * rstd).to(up.dtype)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    arg = gate
    if GELU:  # 0.5 x (1 + tanh(y)) = x / (1 + e^(-2y)), y = sqrt(2 / pi) (x + 0.044715 x^3)
        arg = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
    out = gate / (1.0 + tl.exp(-arg)) * up
    tl.store(out_ptr + t * s_ot + offs * s_oc, out.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x[:, :I], approximate="tanh") * x[:, I:]`` (Gemma's GeGLU), as ``silu_and_mul``
    computes SiLU's (in float32, one rounding)."""
    return silu_and_mul(x, out, gelu=True)


def silu_and_mul(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    norm_of: torch.Tensor | None = None,
    eps: float = 0.0,
    gelu: bool = False,
) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[num_tokens, 2 * I]`` (any strides), computed in
    float32 and stored in ``x.dtype``, into ``out`` ``[num_tokens, I]`` when given.

    With ``norm_of`` ``[num_tokens, hidden]`` (its rows dense), ``x`` is first multiplied row by
    row by ``1 / rms(norm_of[t])`` (``eps`` inside the root) and rounded to its dtype: the RMSNorm
    before a gate/up projection whose weight has the norm's folded in
    (``LlamaForCausalLM.fold_norms``), without its own kernel."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [tokens, 2 * intermediate]: {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if norm_of is None:
        norm_args: tuple[torch.Tensor | int | float, ...] = (x, 0, 1, 0.0)  # unused
    elif norm_of.dim() != 2 or norm_of.shape[0] != num_tokens or norm_of.stride(1) != 1:
        raise ValueError(f"norm_of must be [{num_tokens}, hidden], its rows dense")
    else:
        norm_args = (norm_of, norm_of.stride(0), norm_of.shape[1], eps)
    if out is None:
        out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    else:
        _check_out(out, (num_tokens, inter), x, "silu_and_mul")
    if num_tokens == 0 or inter == 0:
        return out
    block = min(SILU_BLOCK, next_pow2(inter))
    pdl = pdl_launch(x.device)
    # many rows with a norm: one program a row, not one per row and columns block, each of
    # which would read the row of ``norm_of`` again
    row_loop = norm_of is not None and num_tokens >= SILU_ROW_LOOP_MIN_ROWS
    launcher(_silu_and_mul_kernel)(
        (num_tokens, 1 if row_loop else cdiv(inter, block)),
        x,
        out,
        inter,
        *x.stride(),
        *out.stride(),
        *norm_args,
        BLOCK=block,
        NORM=norm_of is not None,
        BLOCK_HID=next_pow2(norm_of.shape[1]) if norm_of is not None else 1,
        ROW_LOOP=row_loop,
        GELU=gelu,
        num_warps=_num_warps(block),
        **pdl,
    )
    return out


def ref_gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def ref_silu_and_mul(
    x: torch.Tensor, norm_of: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    if norm_of is not None:
        rstd = torch.rsqrt(norm_of.float().pow(2).mean(-1, keepdim=True) + eps)
        x = (x.float() * rstd).to(x.dtype)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# --------------------------------------------------------------------------------------------
# RMSNorm, with the residual add fused in front


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,  # read and overwritten with x + residual when HAS_RESIDUAL
    w_ptr,
    out_ptr,
    hidden,
    eps,
    s_xt,
    s_xc,
    s_rt,
    s_rc,
    s_w,
    s_ot,
    s_oc,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + t * s_xt + offs * s_xc, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + t * s_rt + offs * s_rc
        res = tl.load(res_ptrs, mask=mask, other=0.0)
        # the sum is rounded to the dtype, as torch's ``hidden + x``, and normalized from there
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(res_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs * s_w, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_ot + offs * s_oc, (xf * rstd * w).to(x.dtype), mask=mask)


def _check_norm(x: torch.Tensor, weight: torch.Tensor, what: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{what}: x must be [tokens, hidden]: {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: unsupported dtype {x.dtype}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"{what}: weight is {tuple(weight.shape)} {weight.dtype} on {weight.device}, "
            f"expected ({x.shape[1]},) {x.dtype} on {x.device}"
        )


def _launch_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    what: str,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    else:
        _check_out(out, (num_tokens, hidden), x, what)
    if num_tokens == 0 or hidden == 0:
        return out
    res = x if residual is None else residual
    block = next_pow2(hidden)
    pdl = pdl_launch(x.device)
    launcher(_rms_norm_kernel)(
        (num_tokens,),
        x,
        res,
        weight,
        out,
        hidden,
        float(eps),
        *x.stride(),
        *res.stride(),
        weight.stride(0),
        *out.stride(),
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=_num_warps(block),
        **pdl,
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden], overwritten with x + residual
    weight: torch.Tensor,  # [hidden], same dtype
    eps: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` (in the dtype, as torch's ``residual + x``), then ``(rms_norm(residual)
    * weight, residual)`` with float32 statistics, like ``F.rms_norm`` of the sum."""
    _check_norm(x, weight, "fused_add_rms_norm")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"fused_add_rms_norm: residual is {tuple(residual.shape)} {residual.dtype} on "
            f"{residual.device}, x is {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    return _launch_norm(x, residual, weight, eps, out, "fused_add_rms_norm"), residual


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden], same dtype
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.rms_norm(x, (hidden,), weight, eps)`` with float32 statistics."""
    _check_norm(x, weight, "rms_norm")
    return _launch_norm(x, None, weight, eps, out, "rms_norm")


def ref_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's torch code path; ``residual`` is left as it is."""
    new_residual = x + residual
    normed = torch.nn.functional.rms_norm(new_residual, weight.shape, weight, eps)
    return normed, new_residual


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


@triton.jit
def _norm_heads(x_ptr, w_ptr, t, head_block, num_heads, head_dim, eps, s_t, s_h,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """RMSNorm of token ``t``'s heads ``head_block * BLOCK_H`` on, each over its own
    ``head_dim`` values, in place."""
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < head_dim)[None, :]
    ptrs = x_ptr + t * s_t + offs_h[:, None] * s_h + offs_d[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / head_dim + eps)
    w = tl.load(w_ptr + offs_d, mask=offs_d < head_dim, other=0.0).to(tl.float32)
    tl.store(ptrs, (xf * rstd[:, None] * w[None, :]).to(x.dtype), mask=mask)


@triton.jit
def _head_rms_norm_kernel(
    q_ptr,
    k_ptr,
    q_w_ptr,
    k_w_ptr,
    num_q_heads,
    num_k_heads,
    head_dim,
    eps,
    s_qt,
    s_qh,
    s_kt,
    s_kh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (t, j): token t's query heads block j, or key heads block j - #query blocks."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if j < q_blocks:
        _norm_heads(q_ptr, q_w_ptr, t, j, num_q_heads, head_dim, eps, s_qt, s_qh,
                    BLOCK_H, BLOCK_D)  # fmt: skip
    else:
        _norm_heads(k_ptr, k_w_ptr, t, j - q_blocks, num_k_heads, head_dim, eps, s_kt, s_kh,
                    BLOCK_H, BLOCK_D)  # fmt: skip


def head_rms_norm_(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], head_dim contiguous
    key: torch.Tensor,  # [num_tokens, num_k_heads, head_dim]
    q_weight: torch.Tensor,  # [head_dim], the query's dtype
    k_weight: torch.Tensor,  # [head_dim]
    eps: float,
) -> None:
    """Qwen3's q/k norms in one launch, in place: each head of ``query`` and ``key`` (strided
    views of the projection's output are fine) becomes its RMSNorm over ``head_dim`` times the
    weight, with float32 statistics, as ``F.rms_norm`` gives."""
    for name, x, w in (("query", query, q_weight), ("key", key, k_weight)):
        if x.dim() != 3 or x.stride(2) != 1:
            raise ValueError(
                f"head_rms_norm_: {name} must be [tokens, heads, head_dim] with contiguous "
                f"heads: {tuple(x.shape)} strides {x.stride()}"
            )
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"head_rms_norm_: unsupported dtype {x.dtype}")
        if w.shape != (x.shape[2],) or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"head_rms_norm_: {name} weight is {tuple(w.shape)} {w.dtype}, "
                             f"expected ({x.shape[2]},) {x.dtype}")  # fmt: skip
    if key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(f"head_rms_norm_: query {tuple(query.shape)} and key "
                         f"{tuple(key.shape)} do not match")  # fmt: skip
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    if num_tokens == 0:
        return
    block_d = next_pow2(head_dim)
    block_h = max(1, min(next_pow2(max(num_q_heads, num_k_heads)), 4096 // block_d))
    blocks = cdiv(num_q_heads, block_h) + cdiv(num_k_heads, block_h)
    launcher(_head_rms_norm_kernel)(
        (num_tokens, blocks), query, key, q_weight, k_weight, num_q_heads, num_k_heads,
        head_dim, float(eps), query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_num_warps(block_h * block_d),
        **pdl_launch(query.device),
    )  # fmt: skip


def ref_head_rms_norm(
    query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The model's torch code path: ``(q_norm(query), k_norm(key))``, new tensors."""
    norm = torch.nn.functional.rms_norm
    return norm(query, q_weight.shape, q_weight, eps), norm(key, k_weight.shape, k_weight, eps)


# --------------------------------------------------------------------------------------------
# argmax over the vocabulary

ARGMAX_CHUNK = 4096  # logits per program
ARGMAX_WARPS: int | None = None  # warps per program (None: 4, or 1 for chunks under 1,024)
_ARGMAX_PAD = tl.constexpr(2**31 - 1)  # an index past every chunk's


@triton.jit(do_not_specialize=["V"])
def _argmax_kernel(
    logits_ptr,  # [B, V], rows contiguous
    part_val_ptr,  # [B, NUM_CHUNKS] fp32
    part_idx_ptr,  # [B, NUM_CHUNKS] int32
    counter_ptr,  # [B] int32, zero between launches
    out_ptr,  # [B] int64
    V,
    s_b,
    NUM_CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + b * s_b + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch.argmax
    best = tl.max(x, 0)
    # the first index holding the maximum (torch's tie-break)
    idx = tl.min(tl.where(x == best, offs, _ARGMAX_PAD), 0)
    tl.store(part_val_ptr + b * NUM_CHUNKS + c, best)
    tl.store(part_idx_ptr + b * NUM_CHUNKS + c, idx)
    # the last chunk of the row to finish sees every partial (as decode_attention's reduce)
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr + b, 1, sem="acq_rel", scope="gpu") == NUM_CHUNKS - 1:
        tl.debug_barrier()
        tl.store(counter_ptr + b, 0)
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < NUM_CHUNKS
        vals = tl.load(
            part_val_ptr + b * NUM_CHUNKS + offs_c,
            mask=c_ok,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        idxs = tl.load(
            part_idx_ptr + b * NUM_CHUNKS + offs_c,
            mask=c_ok,
            other=_ARGMAX_PAD,
            cache_modifier=".cg",
        )
        top = tl.max(vals, 0)
        tl.store(out_ptr + b, tl.min(tl.where(vals == top, idxs, _ARGMAX_PAD), 0).to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``[B, V]`` logits (rows contiguous) as int64, in one launch
    of ``B x V / ARGMAX_CHUNK`` programs. On an H200 (benchmarks/device/b1_kernels.py) one row
    of Llama's 128,256 logits took 2.9 us against torch's 26.3, 256 rows of Qwen's 151,936
    31.1 against 54.2. Ties go to the first index and NaN counts as the largest, as in torch.
    Its launch costs the host ~25 us more than torch's, hidden when steps run ahead."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"argmax: logits must be [B, V] with contiguous rows in {SUPPORTED_DTYPES}, not "
            f"{tuple(logits.shape)} {logits.dtype} with strides {logits.stride()}"
        )
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0 or vocab == 0:
        if vocab == 0 and rows:
            raise ValueError("argmax: an empty vocabulary")
        return out
    chunk = min(ARGMAX_CHUNK, max(16, next_pow2(vocab)))
    num_chunks = cdiv(vocab, chunk)
    part_val = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    launcher(_argmax_kernel)(
        (rows, num_chunks),
        logits,
        part_val,
        part_idx,
        zeroed_counters(logits.device, rows, "argmax"),
        out,
        vocab,
        logits.stride(0),
        NUM_CHUNKS=num_chunks,
        CHUNK=chunk,
        BLOCK_C=next_pow2(num_chunks),
        num_warps=ARGMAX_WARPS or (4 if chunk >= 1024 else 1),
    )
    return out
