# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""Attention for a mixed batch of variable-length query chunks against the paged KV cache.

Request ``i`` has query tokens ``query_start_loc[i]:query_start_loc[i + 1]`` and ``seq_lens[i]``
keys in the cache (its new tokens' K/V are written before this runs). Query row ``r`` of the
chunk sits at position ``ctx_len + r`` with ``ctx_len = seq_len - query_len`` and sees keys
``0 .. ctx_len + r``:

    keys:    | cached context (ctx_len) | new tokens (query_len) |
    row 0:   |<------------------------>|x
    row 1:   |<------------------------>|xx
    row r:   |<------------------------>|x ... x (r + 1)

One program takes ``BLOCK_Q`` consecutive query tokens of one request and all ``GROUP`` query heads
of one KV head: tile row ``m`` is token ``m // GROUP``, head ``m % GROUP``, so each K/V tile is
read once for the whole group and any ratio (7 included) fills the rows. Tiles that lie wholly
below the first row's diagonal run without a mask.

With a sliding ``window`` W (``WINDOWED``), row ``r`` sees keys ``q_pos - W < j <= q_pos`` only:
the key loop starts at the tile of the first row's first key, and the tiles before the last row's
first key are masked as the diagonal's are; those between, which every row sees whole, run
without a mask. With a ``softcap`` (``SOFTCAP``) the scores are capped before the mask. Both are
constexpr flags with the values as runtime arguments: one compiled variant serves any window
and cap, and with both off the kernel is the one without them.

Programs are numbered per request: request ``i``'s q-blocks start at ``query_start_loc[i] //
BLOCK_Q + i``, which leaves a few idle programs but lets each find its request by binary search
with no host-side work list. ``HEAVY_FIRST`` walks that numbering backwards, so each request's
last q-blocks (the most keys, under the causal mask) start first and the grid ends on light ones.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from baton_kernels.attention.base import KVCacheView
from baton_kernels.triton.common import (
    LOG2E,
    block_d,
    check_kv_cache,
    check_window_softcap,
    dot_precision,
    load_kv_tile,
    next_pow2,
    online_softmax_step,
    tile_scores,
    upcast_in_kernel,
)
from baton_kernels.triton.launch import launcher


class PrefillConfig(NamedTuple):
    """A launch of the kernel: tile rows (query tokens x the group's heads), keys per tile,
    warps, software-pipeline stages, and the program order (``HEAVY_FIRST``)."""

    rows: int
    tile_n: int
    num_warps: int
    num_stages: int
    heavy_first: bool = False


# The launch for chunks longer than a few tokens of 16-bit queries, by padded head size: the best
# of 39 (mean TFLOP/s over 32 x 512 tokens, 1 x 8,192 and 8 x 512 over 4,096 cached; H200,
# benchmarks/device/ab_prefill.sh). Against 64 rows, 64-key tiles, 4 warps, 2 stages (kept for
# float32 and other head sizes): Qwen's shape (head 64) 250 against 219 TFLOP/s, Llama's (128)
# 292 against 262.
LONG_CHUNK_CONFIGS = {
    64: PrefillConfig(128, 64, 8, 2, heavy_first=True),
    128: PrefillConfig(128, 32, 4, 3, heavy_first=True),
}


@triton.jit
def _find_request(cu_q_ptr, q_base, pid, num_reqs, BLOCK_Q: tl.constexpr):
    """The last request whose first q-block number is <= pid."""
    left: tl.int32 = 0
    right = num_reqs
    while left < right:
        mid = (left + right) // 2
        first = (tl.load(cu_q_ptr + mid) - q_base) // BLOCK_Q + mid
        if first <= pid:
            left = mid + 1
        else:
            right = mid
    return left - 1


# Values that change from step to step are not specialised on (Triton would otherwise compile a
# new variant, for ~1 s, whenever the request count or the table width crosses a multiple of 16,
# or a slice starts at another alignment). Nor is the window: one variant serves every size.
@triton.jit(
    do_not_specialize=["num_reqs", "s_tb", "window"],
    do_not_specialize_on_alignment=["cu_q_ptr", "seq_lens_ptr", "tables_ptr"],
)
def _paged_attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    cu_q_ptr,  # [num_reqs + 1]
    seq_lens_ptr,  # [num_reqs]
    tables_ptr,  # [num_reqs, max_blocks]
    num_reqs,
    qk_scale,  # softmax scale * log2(e)
    s_qt,
    s_qh,
    s_qd,
    s_ot,
    s_oh,
    s_od,
    s_cb,
    s_ckv,
    s_cs,
    s_ch,
    s_cd,
    s_tb,
    window,  # WINDOWED: keys each row sees (its own included)
    cap,  # SOFTCAP: the softcap * log2(e)
    v_scale,  # the output times the V scale (an 8-bit cache's; the K scale is in qk_scale)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    if HEAVY_FIRST:
        pid = tl.num_programs(0) - 1 - pid
    kv_head = tl.program_id(1)
    q_base = tl.load(cu_q_ptr)
    req = _find_request(cu_q_ptr, q_base, pid, num_reqs, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_start
    q_block = pid - ((q_start - q_base) // BLOCK_Q + req)
    if q_block * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + req) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + offs_m // GROUP  # token inside the chunk
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :] * s_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx_len + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_ptr = tables_ptr + req.to(tl.int64) * s_tb
    kv_end = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    # every row of this program sees keys [0, ctx_len + q_block * BLOCK_Q]
    unmasked_end = (ctx_len + q_block * BLOCK_Q + 1) // TILE_N * TILE_N
    unmasked_start = 0
    if WINDOWED:
        # The first row sees keys from ctx_len + q_block * BLOCK_Q - window + 1 on, the last
        # from kv_end - window on (either from 0 where negative): the tiles before the first
        # row's first key are skipped, those before the last row's masked.
        first = tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0) // TILE_N * TILE_N
        seen_by_all = tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N) * TILE_N
        unmasked_start = tl.minimum(seen_by_all, unmasked_end)
        for start in range(first, unmasked_start, TILE_N):
            pos = start + tl.arange(0, TILE_N)  # all below unmasked_end: no row's diagonal
            k, v = load_kv_tile(
                kv_ptr, table_ptr, pos, pos < kv_end, kv_head, offs_d,
                s_cb, s_ckv, s_cs, s_ch, s_cd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, False, UPCAST,
            )  # fmt: skip
            k, v = k.to(q.dtype), v.to(q.dtype)  # (an 8-bit cache's)
            s = tile_scores(q, k, qk_scale, cap, SOFTCAP, DOT_PREC)
            s = tl.where(pos[None, :] > q_pos[:, None] - window, s, float("-inf"))
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)
    for start in range(unmasked_start, unmasked_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        k, v = load_kv_tile(
            kv_ptr, table_ptr, pos, pos < kv_end, kv_head, offs_d,
            s_cb, s_ckv, s_cs, s_ch, s_cd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, False, UPCAST,
        )  # fmt: skip
        k, v = k.to(q.dtype), v.to(q.dtype)  # (an 8-bit cache's)
        s = tile_scores(q, k, qk_scale, cap, SOFTCAP, DOT_PREC)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)
    for start in range(unmasked_end, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < kv_end
        k, v = load_kv_tile(
            kv_ptr, table_ptr, pos, pos_ok, kv_head, offs_d,
            s_cb, s_ckv, s_cs, s_ch, s_cd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, True, UPCAST,
        )  # fmt: skip
        k, v = k.to(q.dtype), v.to(q.dtype)  # (an 8-bit cache's)
        s = tile_scores(q, k, qk_scale, cap, SOFTCAP, DOT_PREC)
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            visible &= pos[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)

    # (times the V scale after the division: with a scale of 1, what it was without scales)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    tl.store(
        out_ptr + q_row[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :] * s_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], any strides
    kv_cache: KVCacheView,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: written at the batch's tokens only
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int, on the device; may start above 0
    seq_lens: torch.Tensor,  # [num_reqs] int
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int
    scale: float,
    max_query_len: int,
    *,
    window: int = 0,
    softcap: float = 0.0,
    config: PrefillConfig | None = None,
) -> None:
    """Causal attention of each request's query chunk over its ``seq_len`` cached keys (within
    ``window`` of each query and scores capped by ``softcap`` where those are > 0: see
    ``attention.base``). Token indices in ``query_start_loc`` index ``query`` and ``out``
    directly, so a slice of a larger batch (the prefills after its decodes) is passed without
    copying. ``config`` overrides the launch of chunks longer than a few tokens
    (benchmarks/bench_attention_gpu.py --sweep prefill)."""
    check_kv_cache(kv_cache, query)
    check_window_softcap(window, softcap)
    num_reqs = int(seq_lens.shape[0])
    num_tokens, num_heads, head_dim = query.shape
    if num_reqs == 0 or num_tokens == 0:
        return
    kv = kv_cache.kv
    num_kv_heads = kv.shape[3]
    group = num_heads // num_kv_heads
    bd = block_d(head_dim)
    # Short chunks (decodes) get small tiles so few rows are wasted; long ones amortise K/V reads.
    tile_n = 64 if bd <= 128 else 32
    if max_query_len * group > 16:
        tuned = LONG_CHUNK_CONFIGS.get(bd) if query.element_size() == 2 else None
        cfg = config or tuned or PrefillConfig(64, tile_n, 4, 2)
    else:
        cfg = PrefillConfig(16, tile_n, 4, 2)
    block_m = max(cfg.rows, next_pow2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    launcher(_paged_attention_kernel)(
        grid,
        query,
        kv,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        num_reqs,
        scale * kv_cache.k_scale * LOG2E,
        *query.stride(),
        *out.stride(),
        *kv.stride(),
        block_tables.stride(0),
        window,
        softcap * LOG2E,
        kv_cache.v_scale,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=bd,
        BLOCK_SIZE=kv_cache.block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=cfg.tile_n,
        UPCAST=upcast_in_kernel(query),
        DOT_PREC=dot_precision(query.dtype),
        HEAVY_FIRST=cfg.heavy_first,
        WINDOWED=window > 0,
        SOFTCAP=softcap > 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def ref_paged_attention(
    query: torch.Tensor,
    kv_cache: KVCacheView,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] fp32, rows outside the batch are zero
    """One request at a time in fp32: gather its keys from the block table (times the cache's
    scales), cap the scores (``softcap``), mask (causal, and ``window``), softmax."""
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    block_size = kv_cache.block_size
    group = query.shape[1] // kv_cache.kv.shape[3]
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        blocks = block_tables[i, : math.ceil(seq_len / block_size)]
        # [seq_len, kv_heads, dim], what the cache holds (times an 8-bit cache's scales)
        k = kv_cache.key[blocks].flatten(0, 1)[:seq_len].float() * kv_cache.k_scale
        v = kv_cache.value[blocks].flatten(0, 1)[:seq_len].float() * kv_cache.v_scale
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        cols = torch.arange(seq_len, device=query.device)[None, :]
        hidden = cols > q_pos
        if window > 0:
            hidden |= cols <= q_pos - window
        scores.masked_fill_(hidden, -math.inf)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
