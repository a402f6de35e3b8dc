# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""Write new tokens' K/V into the paged cache through the slot mapping.

Token ``t`` goes to ``cache[slot_block[t], :, slot_offset[t]]``; a negative ``slot_block`` marks a
padding token (CUDA-graph batches are padded) and is skipped. An 8-bit cache gets the values
divided by the layer's scales (``KVCacheView.k_scale`` / ``v_scale``), saturated and rounded
to it (``attention.base.to_cache_dtype``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels.attention.base import FP8_KV_DTYPES, KVCacheView, cache_max, to_cache_dtype
from baton_kernels.triton.common import block_d, cache_value, cdiv, next_pow2
from baton_kernels.triton.launch import launcher


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_block_ptr,
    slot_offset_ptr,
    num_kv_heads,
    s_kt,
    s_kh,
    s_kd,
    s_vt,
    s_vh,
    s_vd,
    s_cb,
    s_ckv,
    s_cs,
    s_ch,
    s_cd,
    k_inv,  # 1 / the layer's K and V scales (an 8-bit cache's)
    v_inv,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    block = tl.load(slot_block_ptr + t).to(tl.int64)
    if block < 0:
        return
    offset = tl.load(slot_offset_ptr + t).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_k = key_ptr + t * s_kt + offs_h[:, None] * s_kh + offs_d[None, :] * s_kd
    src_v = value_ptr + t * s_vt + offs_h[:, None] * s_vh + offs_d[None, :] * s_vd
    dst = kv_ptr + block * s_cb + offset * s_cs + offs_h[:, None] * s_ch + offs_d[None, :] * s_cd
    tl.store(dst, cache_value(tl.load(src_k, mask=mask), kv_ptr, k_inv, KV_MAX), mask=mask)
    v = cache_value(tl.load(src_v, mask=mask), kv_ptr, v_inv, KV_MAX)
    tl.store(dst + s_ckv, v, mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any strides
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: KVCacheView,
    slot_block: torch.Tensor,  # [num_tokens] int: block id, < 0 to skip the token
    slot_offset: torch.Tensor,  # [num_tokens] int: offset inside the block
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kv = kv_cache.kv
    check_cache_dtype(kv.dtype, key.dtype, value.dtype)
    bd = block_d(head_dim)
    block_h = min(next_pow2(num_kv_heads), max(1, 4096 // bd))
    grid = (num_tokens, cdiv(num_kv_heads, block_h))
    launcher(_write_kv_kernel)(
        grid,
        key,
        value,
        kv,
        slot_block,
        slot_offset,
        num_kv_heads,
        *key.stride(),
        *value.stride(),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        kv.stride(4),
        1.0 / kv_cache.k_scale,
        1.0 / kv_cache.v_scale,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=bd,
        KV_MAX=cache_max(kv.dtype),
        num_warps=1 if block_h * bd <= 512 else 4,
    )


def check_cache_dtype(cache: torch.dtype, *tensors: torch.dtype) -> None:
    """A ValueError unless a cache of dtype ``cache`` holds tensors of these dtypes: the same,
    or any of them in an 8-bit cache."""
    if cache not in FP8_KV_DTYPES and any(t != cache for t in tensors):
        raise ValueError(f"cache dtype {cache} differs from K/V {'/'.join(map(str, tensors))}")


def ref_write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCacheView,
    slot_block: torch.Tensor,
    slot_offset: torch.Tensor,
) -> None:
    keep = slot_block >= 0
    dtype, slots = kv_cache.kv.dtype, (slot_block[keep], slot_offset[keep])
    kv_cache.key[slots] = to_cache_dtype(key[keep], dtype, kv_cache.k_scale)
    kv_cache.value[slots] = to_cache_dtype(value[keep], dtype, kv_cache.v_scale)
