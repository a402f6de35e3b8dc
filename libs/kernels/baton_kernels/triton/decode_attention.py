# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""Decode attention (one query token per request) with flash-decoding.

A batch of few requests has too few (request, KV head) pairs to fill the GPU's 132 SMs, so each
request's keys are cut into ``num_splits`` equal slices, each attended by its own program:

    keys of request b:  | split 0 | split 1 | ... | split S-1 |    (each a multiple of TILE_N)
    program (b, h, s):  partial output o_s and log-sum-exp lse_s of its slice
    reduce (b, h):      out = sum_s exp(lse_s - max) * o_s / sum_s exp(lse_s - max), per query head

The slice length is computed in the kernel from the request's length, so the grid depends only
on (num_decodes, num_kv_heads, num_splits), not on the lengths: a CUDA graph captured for one
batch size replays for any lengths. Slices are whole tiles, so a short request uses fewer than
``num_splits`` of them (its ``active`` slices); the programs of the others return at once, and
the reduce reads the active ones only. (A graph captured for long contexts launches 64 splits;
at 640 tokens only 10 of them have keys.) With one split the kernel writes the output directly
and the reduce is skipped.

The reduce normally runs in the attention kernel itself: each program counts itself done on a
per-(request, KV head) counter, and the last of a head's splits combines the partials (the
counter is reset to zero by that program, so a CUDA graph replays it as captured). At batch 1 a
decode layer is then one launch instead of two; a decode step of a small model is bound by its
launches. ``fuse_reduce=False`` keeps the separate reduce kernel (for A/B measurements).

One program holds the ``GROUP`` query heads of its KV head as tile rows (padded to 16 for the
tensor cores), so each K/V tile is read once per group.

With a sliding ``window`` W (``WINDOWED``) only the window's keys are read: the slices cut
``[max(seq_len - W, 0), seq_len)`` as they would a request of ``min(seq_len, W)`` keys (so the
kernel, the fused reduce and the separate one count the same active slices), and the slice
that holds the new token is still the last active one. With a ``softcap`` (``SOFTCAP``) each
score is capped. Both are constexpr flags with the values as runtime arguments (one compiled
variant serves any window and cap; with both off the kernel is the one without them).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from baton_kernels.attention.base import KVCacheView, cache_max
from baton_kernels.triton.common import (
    LOG2E,
    block_d,
    bulk_prefetch_ok,
    cache_value,
    cdiv,
    check_kv_cache,
    check_window_softcap,
    dot_precision,
    load_kv_tile,
    next_pow2,
    num_sms,
    online_softmax_step,
    pdl_launch,
    prefetch_rows_l2,
    tile_scores,
    upcast_in_kernel,
    zeroed_counters,
)
from baton_kernels.triton.launch import launcher

# Shorter slices cost more in the reduce than they save. 64 since the reduce is fused: at batch 1
# (Qwen2.5-0.5B shape, context ~640) the decode graph took 0.834 ms against 0.866 with 128.
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 64
FUSE_REDUCE = True  # the default of decode_attention's fuse_reduce
COMBINE_UNROLL = 8  # partials the reduce reads per loop iteration
# When a request's keys are split (few requests), each program under PDL reads the step's
# inputs (lengths, block table, positions, the rotary rows, the new token's slot) before it
# waits for the kernel before it, and starts reading the first PREFETCH_TILES tiles of its
# slice into the L2 (Hopper's bulk prefetch), so that the reads which must wait (q, k, v and
# the stream's row for the norm) are not followed by the first tiles' full latency. On an H200
# (ab_prefetch.sh, ab_host.sh), Qwen2.5-0.5B's batch-1 decode graph: 0.608 ms with neither,
# 0.595-0.597 with the early reads, 0.580-0.582 with both. With one split (256 requests) both
# made the graph slower (1.690-1.695 ms: early reads 1.698-1.702, both 1.725), so neither is
# used there. BATON_DECODE_EARLY=0 / BATON_DECODE_PREFETCH_TILES=0 turn them off.
# Software-pipeline stages of the key loop: with one split a request (many requests, every SM
# full), 2; with several (few requests), 3. Qwen2.5-0.5B's 256-request decode graph on an H200:
# 1.672 / 1.679 ms with 2 against 1.703 / 1.698 with 3 (two pairs of fresh processes,
# benchmarks/device/two_halves.sh), the kernel alone 26.01 against 26.66 us a layer
# (decode_loop.py).
ONE_SPLIT_STAGES = 2
SPLIT_STAGES = 3
# Heads of 128 and more, one split a request, at least WIDE_HEAD_PROGRAMS_PER_SM programs
# (requests x KV heads) an SM: 32 keys a tile, one warp, 3 stages (keys per tile, warps, stages)
# instead of 64 keys and two warps. Llama-3.1-8B's decode attention on an H200
# (benchmarks/device/decode_loop.py, 32 layers, contexts 577-640): 256 requests (15.5 programs
# an SM) 154.6 us a layer against 164.4 (4,128 GB/s against 3,881), 64 requests (3.9 an SM)
# 49.6 against 44.5: one warp a program needs many programs to hide the loads. Compiled for
# sm_90 (benchmarks/decode_kernel_resources.py) it takes 252 registers: 8 programs fill an SM's
# registers, 8 warps as 4 of the two-warp launch (234 registers). The engine's 256-request run:
# graph 12.42 ms against 12.62, 10,651 tok/s against 10,543 (ab_wide_head.sh). None: the
# defaults everywhere.
ONE_SPLIT_WIDE_HEAD: tuple[int, int, int] | None = (32, 1, 3)
WIDE_HEAD_PROGRAMS_PER_SM = 8
EARLY_INPUTS = os.environ.get("BATON_DECODE_EARLY", "1") != "0"
PREFETCH_TILES = int(os.environ.get("BATON_DECODE_PREFETCH_TILES", "1"))


@triton.jit
def _split_bounds(
    seq_len, window, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr, WINDOWED: tl.constexpr
):
    """A request's slice length (whole tiles) and how many slices hold its keys (at least one:
    split 0 always runs and, alone, reduces); with ``WINDOWED``, of its last ``window`` keys."""
    if WINDOWED:
        seq_len = tl.minimum(seq_len, window)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N), 1) * TILE_N
    return split_len, tl.maximum(tl.cdiv(seq_len, split_len), 1)


@triton.jit
def _normed(x, rstd, bias_ptr, rows, cols, mask, HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A tile of a folded projection's output ``x`` (``DecodeNorm``) times its row's 1/rms, plus
    the bias (``rows`` of ``HEAD_DIM`` values), rounded to ``x``'s dtype as the projection's
    output is."""
    y = x.to(tl.float32) * rstd
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows[:, None] * HEAD_DIM + cols[None, :], mask=mask, other=0.0)
    return y.to(x.dtype)


@triton.jit
def _rotation(cs_ptr, s_cc, s_cd, offs_d, d_ok, dtype: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The cos row at ``cs_ptr`` and the sin row ``s_cc`` after it (rotate-half layout) as
    float32 vectors, rounded to ``dtype`` first, as the model's ``cos_sin[positions].to(dtype)``;
    the sin negated on the first half: ``rotate_half(x) = cat(-x2, x1)``."""
    cos = tl.load(cs_ptr + offs_d * s_cd, mask=d_ok, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cs_ptr + s_cc + offs_d * s_cd, mask=d_ok, other=0.0).to(dtype).to(tl.float32)
    return cos, tl.where(offs_d < HEAD_DIM // 2, -sin, sin)


@triton.jit
def _rotated(
    x_ptr, rows, row_ok, s_h, s_d, cos, sin, offs_d, d_ok, rstd, bias_ptr,
    HEAD_DIM: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Rows ``rows`` of ``x`` (heads at stride ``s_h``) rotated by one position (``cos`` and
    ``sin`` from ``_rotation``), rounded to ``x``'s dtype: ``fused_ops._rotate_heads`` over the
    whole head dim, each dim with its partner. With ``NORM``, ``x`` is normed first
    (``_normed``)."""
    partner = tl.where(offs_d < HEAD_DIM // 2, offs_d + HEAD_DIM // 2, offs_d - HEAD_DIM // 2)
    mask = row_ok[:, None] & d_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * s_h + offs_d[None, :] * s_d, mask=mask, other=0.0)
    xp = tl.load(x_ptr + rows[:, None] * s_h + partner[None, :] * s_d, mask=mask, other=0.0)
    if NORM:
        x = _normed(x, rstd, bias_ptr, rows, offs_d, mask, HEAD_DIM, HAS_BIAS)
        xp = _normed(xp, rstd, bias_ptr, rows, partner, mask, HEAD_DIM, HAS_BIAS)
    return (x.to(tl.float32) * cos[None, :] + xp.to(tl.float32) * sin[None, :]).to(x.dtype)


@triton.jit(
    # the table width changes from step to step; one variant serves every window
    do_not_specialize=["s_tb", "window"],
    do_not_specialize_on_alignment=[
        "seq_lens_ptr", "tables_ptr", "pos_ptr", "slot_block_ptr", "slot_offset_ptr"
    ],
)  # fmt: skip
def _decode_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,  # [num_decodes, num_heads, head_dim], written when NUM_SPLITS == 1
    part_out_ptr,  # [num_decodes, num_heads, NUM_SPLITS, HEAD_DIM] fp32
    part_lse_ptr,  # [num_decodes, num_heads, NUM_SPLITS] fp32, log2 domain
    seq_lens_ptr,
    tables_ptr,
    counter_ptr,  # [num_decodes * num_kv_heads] int32, zero between launches (FUSE_REDUCE)
    qk_scale,
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
    pos_ptr,  # ROPE: each request's position, the rotary table, the new K/V rows, their slots
    cos_sin_ptr,
    k_ptr,
    v_ptr,
    slot_block_ptr,
    slot_offset_ptr,
    s_csp,  # cos_sin strides: position, cos/sin, dim
    s_csc,
    s_csd,
    s_kt,
    s_kh,
    s_kd,
    s_vt,
    s_vh,
    s_vd,
    hid_ptr,  # NORM: each request's row of the stream the folded norm reads, its q/k/v biases
    s_hid,
    hidden,
    eps,
    qb_ptr,
    kb_ptr,
    vb_ptr,
    window,  # WINDOWED: keys the query sees (its own included)
    cap,  # SOFTCAP: the softcap * log2(e)
    k_inv,  # ROPE: 1 / the layer's K and V scales (an 8-bit cache's)
    v_inv,
    v_scale,  # the output times the V scale (the K scale is in qk_scale)
    ROPE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_HID: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FUSE_REDUCE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    UNROLL: tl.constexpr,
    PREFETCH: tl.constexpr,  # keys read into the L2 before the wait (0: none)
    ROW_BYTES: tl.constexpr,  # bytes of one key's row of one KV head
    EARLY: tl.constexpr,  # the step's inputs read before the PDL wait
    KV_MAX: tl.constexpr,  # ROPE: cache_value's saturation (an 8-bit cache's)
    PDL: tl.constexpr,
):
    # Under PDL this launch may start while the kernel before it (the qkv projection) still
    # runs. With EARLY, what that kernel does not write (the step's inputs, the rotary table,
    # the cached keys with PREFETCH) is read before the wait, so those reads overlap its end
    # and the latency of the reads that must follow it (q, k, v, the stream's row).
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if not EARLY:
            tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    split_len, active = _split_bounds(seq_len, window, NUM_SPLITS, TILE_N, WINDOWED)
    if split >= active:
        return
    start = split * split_len
    if WINDOWED:  # the slices start at the window's first key (anywhere in a block)
        start += tl.maximum(seq_len - window, 0)
    end = tl.minimum(start + split_len, seq_len)
    full_end = start + (end - start) // TILE_N * TILE_N
    table_ptr = tables_ptr + b * s_tb
    if PREFETCH > 0:  # the slice's first PREFETCH keys into the L2 (see decode_attention)
        ahead = start + tl.arange(0, PREFETCH)
        ahead_ok = ahead < end
        ahead_block = tl.load(table_ptr + ahead // BLOCK_SIZE, mask=ahead_ok, other=0)
        keys = kv_ptr + ahead_block.to(tl.int64) * s_cb + (ahead % BLOCK_SIZE) * s_cs
        prefetch_rows_l2(keys + kv_head * s_ch, ahead_ok, ROW_BYTES)
        prefetch_rows_l2(keys + kv_head * s_ch + s_ckv, ahead_ok, ROW_BYTES)

    offs_h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + offs_h
    h_ok = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if ROPE:
        # q rotated here, in every slice's program; the program of the last slice (which
        # holds the new token) writes the rotated K and the V into the cache first
        cs = cos_sin_ptr + tl.load(pos_ptr + b).to(tl.int64) * s_csp
        cos, sin = _rotation(cs, s_csc, s_csd, offs_d, d_ok, q_ptr.dtype.element_ty, HEAD_DIM)
        slot_block = tl.load(slot_block_ptr + b).to(tl.int64)
        slot = tl.load(slot_offset_ptr + b).to(tl.int64)
        if PDL and EARLY:
            tl.extra.cuda.gdc_wait()
        rstd = 1.0
        if NORM:  # the 1/rms of the request's row of the stream (DecodeNorm)
            offs_x = tl.arange(0, BLOCK_HID)
            xs = tl.load(hid_ptr + b * s_hid + offs_x, mask=offs_x < hidden, other=0.0)
            xs = xs.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xs * xs, axis=0) / hidden + eps)
        q = _rotated(q_ptr + b * s_qt, head, h_ok, s_qh, s_qd, cos, sin, offs_d, d_ok,
                     rstd, qb_ptr, HEAD_DIM, NORM, HAS_BIAS)  # fmt: skip
        if split == active - 1:
            if slot_block >= 0:  # (a padding row's is negative)
                one = offs_h == 0  # a tile of one row
                rows = kv_head + 0 * offs_h
                k_new = _rotated(k_ptr + b * s_kt, rows, one, s_kh, s_kd, cos, sin,
                                 offs_d, d_ok, rstd, kb_ptr, HEAD_DIM, NORM, HAS_BIAS)  # fmt: skip
                mask = one[:, None] & d_ok[None, :]
                v_new = tl.load(
                    v_ptr + b * s_vt + rows[:, None] * s_vh + offs_d[None, :] * s_vd, mask=mask
                )
                if NORM:
                    v_new = _normed(v_new, rstd, vb_ptr, rows, offs_d, mask, HEAD_DIM, HAS_BIAS)
                dst = (
                    kv_ptr + slot_block * s_cb + slot * s_cs + rows[:, None] * s_ch
                    + offs_d[None, :] * s_cd
                )  # fmt: skip
                tl.store(dst, cache_value(k_new, kv_ptr, k_inv, KV_MAX), mask=mask)
                tl.store(dst + s_ckv, cache_value(v_new, kv_ptr, v_inv, KV_MAX), mask=mask)
            tl.debug_barrier()  # the stores are seen by this program's loads of its tiles
    else:
        if PDL and EARLY:
            tl.extra.cuda.gdc_wait()
        q = tl.load(
            q_ptr + b * s_qt + head[:, None] * s_qh + offs_d[None, :] * s_qd,
            mask=h_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile in range(start, full_end, TILE_N):
        pos = tile + tl.arange(0, TILE_N)
        k, v = load_kv_tile(
            kv_ptr, table_ptr, pos, pos < end, kv_head, offs_d,
            s_cb, s_ckv, s_cs, s_ch, s_cd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, False, UPCAST,
        )  # fmt: skip
        k, v = k.to(q.dtype), v.to(q.dtype)  # (an 8-bit cache's)
        s = tile_scores(q, k, qk_scale, cap, SOFTCAP, DOT_PREC)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)
    if full_end < end:
        pos = full_end + tl.arange(0, TILE_N)
        pos_ok = pos < end
        k, v = load_kv_tile(
            kv_ptr, table_ptr, pos, pos_ok, kv_head, offs_d,
            s_cb, s_ckv, s_cs, s_ch, s_cd, BLOCK_SIZE, HEAD_DIM, BLOCK_D, True, UPCAST,
        )  # fmt: skip
        k, v = k.to(q.dtype), v.to(q.dtype)  # (an 8-bit cache's)
        s = tile_scores(q, k, qk_scale, cap, SOFTCAP, DOT_PREC)
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)

    # (times the V scale after the division: with a scale of 1, what it was without scales)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * s_ot + head[:, None] * s_oh + offs_d[None, :] * s_od,
            out.to(out_ptr.dtype.element_ty),
            mask=h_ok[:, None] & d_ok[None, :],
        )
    else:
        row = (b * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            out,
            mask=h_ok[:, None] & d_ok[None, :],
        )
        lse = m_i + tl.log2(l_i)  # an active slice has keys: l > 0
        tl.store(part_lse_ptr + row, lse, mask=h_ok)
        if FUSE_REDUCE:
            # every thread's partials are stored before the release of the count; the last
            # program's acquire makes all of them visible to it (read past L1: ".cg")
            tl.debug_barrier()
            counter = counter_ptr + b * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
                tl.debug_barrier()
                tl.store(counter, 0)
                _combine_splits(
                    part_out_ptr, part_lse_ptr, out_ptr, b, head, h_ok, offs_d, d_ok, active,
                    s_ot, s_oh, s_od, NUM_HEADS, NUM_SPLITS, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_S,
                    UNROLL,
                )  # fmt: skip


@triton.jit
def _add_partial(
    acc, total, part_out_ptr, part_lse_ptr, first, s, active, top, h_ok, offs_d, d_ok,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Slice ``s``'s partial output, weighted by exp(lse - top), into ``acc`` and its weight
    into ``total``; nothing past ``active``."""
    lse_s = tl.load(
        part_lse_ptr + first + s,
        mask=h_ok & (s < active),
        other=float("-inf"),
        cache_modifier=".cg",
    )
    weight = tl.exp2(lse_s - top)
    part = tl.load(
        part_out_ptr + (first + s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=(weight > 0)[:, None] & d_ok[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    return acc + part * weight[:, None], total + weight


@triton.jit
def _combine_splits(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    b,
    head,  # [BLOCK_H] query heads
    h_ok,
    offs_d,
    d_ok,
    active,  # the slices with keys: partials 0 .. active - 1 are written
    s_ot,
    s_oh,
    s_od,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """out[b, head] from the heads' ``active`` partial outputs, weighted by exp(lse - max)."""
    offs_s = tl.arange(0, BLOCK_S)
    first = (b * NUM_HEADS + head) * NUM_SPLITS  # [BLOCK_H]
    lse = tl.load(
        part_lse_ptr + first[:, None] + offs_s[None, :],
        mask=h_ok[:, None] & (offs_s < active)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    # split 0 is always active, so a real head's max is finite; padding heads get 0
    top = tl.where(h_ok, tl.max(lse, 1), 0.0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    # UNROLL slices at a time, masked past `active`: their loads issue together, and a graph
    # captured with 64 splits does not pay for 64 at every length. Up to UNROLL splits, one
    # unrolled pass without a loop (a loop of one round cost 0.9 us at 8 splits on an H200).
    if NUM_SPLITS > UNROLL:
        for r in range(0, tl.cdiv(active, UNROLL)):
            for j in tl.static_range(UNROLL):
                acc, total = _add_partial(
                    acc, total, part_out_ptr, part_lse_ptr, first, r * UNROLL + j, active,
                    top, h_ok, offs_d, d_ok, HEAD_DIM,
                )  # fmt: skip
    else:
        for j in tl.static_range(NUM_SPLITS):
            acc, total = _add_partial(
                acc, total, part_out_ptr, part_lse_ptr, first, j, active,
                top, h_ok, offs_d, d_ok, HEAD_DIM,
            )  # fmt: skip
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        out_ptr + b * s_ot + head[:, None] * s_oh + offs_d[None, :] * s_od,
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & d_ok[None, :],
    )


@triton.jit(do_not_specialize=["window"])
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    seq_lens_ptr,
    s_ot,
    s_oh,
    s_od,
    window,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    UNROLL: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """The combine as a launch of its own (``fuse_reduce=False``): program (b, KV head)."""
    b = tl.program_id(0).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    _, active = _split_bounds(seq_len, window, NUM_SPLITS, TILE_N, WINDOWED)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    _combine_splits(
        part_out_ptr, part_lse_ptr, out_ptr, b,
        tl.program_id(1) * GROUP + offs_h, offs_h < GROUP, offs_d, offs_d < HEAD_DIM, active,
        s_ot, s_oh, s_od, NUM_HEADS, NUM_SPLITS, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_S, UNROLL,
    )  # fmt: skip


def choose_num_splits(
    num_decodes: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """One split once (decodes x KV heads) covers the SMs twice; below that, enough splits for
    about four programs per SM, none shorter than MIN_SPLIT_TOKENS; a power of two (rounded
    down) so few variants get compiled. Fitted to a split-count sweep on an H200
    (``bench_attention_gpu.py --sweep splits``): within 5% of the best count at each point."""
    sms = num_sms(device)
    programs = max(num_decodes * num_kv_heads, 1)
    if programs >= 2 * sms:
        return 1
    wanted = cdiv(4 * sms, programs)
    by_len = cdiv(max_seq_len, MIN_SPLIT_TOKENS)
    splits = max(1, min(wanted, by_len, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def decode_launch(
    head_dim: int, num_decodes: int, num_kv_heads: int, num_splits: int, device: torch.device
) -> tuple[int, int, int]:
    """``decode_attention``'s default launch: (keys per tile, warps, software-pipeline stages)."""
    few, many = decode_launches(head_dim, num_splits)
    enough = num_decodes * num_kv_heads >= WIDE_HEAD_PROGRAMS_PER_SM * num_sms(device)
    return many if enough else few


def decode_launches(head_dim: int, num_splits: int) -> tuple[tuple[int, int, int], ...]:
    """``decode_launch``'s choices at this head size and split count: with few programs and
    with many (the same launch but for ``ONE_SPLIT_WIDE_HEAD``)."""
    wide = block_d(head_dim) >= 128
    # best of a sweep on an H200 (bench_attention_gpu.py --sweep configs), bf16
    stages = ONE_SPLIT_STAGES if num_splits == 1 else SPLIT_STAGES
    few = (64, 2, stages) if wide else (128, 4, stages)
    if wide and num_splits == 1 and ONE_SPLIT_WIDE_HEAD is not None:
        return few, ONE_SPLIT_WIDE_HEAD
    return few, few


def split_counts(max_keys: int | None = None) -> list[int]:
    """Every ``num_splits`` that ``choose_num_splits`` can return (each is its own compiled
    variant of the kernel), for at most ``max_keys`` keys a decode."""
    top = MAX_SPLITS if max_keys is None else min(MAX_SPLITS, cdiv(max_keys, MIN_SPLIT_TOKENS))
    return [1 << i for i in range(top.bit_length())]


class DecodeNorm(NamedTuple):
    """A decode layer's input RMSNorm folded into its qkv projection (the norm's weight
    multiplied into the projection's columns, ``LlamaForCausalLM.fold_norms``): the query, key
    and value ``decode_attention`` reads are rows of ``stream @ weight.T``, without the bias, and
    the kernel multiplies each by its request's 1/rms of ``stream`` and adds the bias, where the
    unfolded layer runs a norm kernel before the projection. (Prompt steps hand the same to
    ``fused_ops.rotary_embedding_and_write_kv_``, one row a token.)"""

    stream: torch.Tensor  # [num_decodes, hidden], the rows the projection read (last dim dense)
    eps: float
    bias: torch.Tensor | None  # [num_heads + 2 * num_kv_heads, head_dim] q, k, v, or None


class DecodeRope(NamedTuple):
    """What ``decode_attention`` needs to rotate q and write the new K/V itself (the work of
    ``fused_ops.rotary_embedding_and_write_kv_`` for a decode-only step), one row a request."""

    positions: torch.Tensor  # [num_decodes] int
    cos_sin: torch.Tensor  # [max_positions, 2, head_dim] (cos then sin)
    key: torch.Tensor  # [num_decodes, num_kv_heads, head_dim], not rotated, any strides
    value: torch.Tensor  # [num_decodes, num_kv_heads, head_dim], any strides
    slot_block: torch.Tensor  # [num_decodes] int: block id, < 0 to skip the row
    slot_offset: torch.Tensor  # [num_decodes] int: offset inside that block
    norm: DecodeNorm | None = None  # q, k and v still to be normed (a folded layer)


def decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim], any strides
    kv_cache: KVCacheView,
    out: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    seq_lens: torch.Tensor,  # [num_decodes] int, on the device
    block_tables: torch.Tensor,  # [num_decodes, max_blocks] int
    scale: float,
    num_splits: int,
    *,
    window: int = 0,
    softcap: float = 0.0,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fuse_reduce: bool | None = None,
    rope: DecodeRope | None = None,
) -> None:
    """Attention of each request's single query token over its ``seq_len`` cached keys (its own
    K/V included, written before): its last ``window`` keys only and scores capped by
    ``softcap``, where those are > 0 (see ``attention.base``). ``num_splits`` from
    ``choose_num_splits``, or fixed when the launch is captured in a CUDA graph. ``tile_n``
    (keys per tile), ``num_warps`` and ``num_stages`` (default ``ONE_SPLIT_STAGES`` or
    ``SPLIT_STAGES``) are tuning knobs (benchmarks/bench_attention_gpu.py --sweep);
    ``fuse_reduce`` (default ``FUSE_REDUCE``) combines the splits in the last program instead
    of a second launch. With ``rope``, ``query`` is not rotated yet and the new tokens' K/V are
    not in the cache: the kernel rotates q (leaving ``query`` as it is) and writes the rotated
    K and the V at each request's slot before it reads the keys, one launch instead of two;
    with ``rope.norm`` it also applies the layer's input RMSNorm that was folded into the
    projection (``DecodeNorm``) to q, k and v first."""
    check_kv_cache(kv_cache, query)
    check_window_softcap(window, softcap)
    num_decodes, num_heads, head_dim = query.shape
    if num_decodes == 0:
        return
    kv = kv_cache.kv
    num_kv_heads = kv.shape[3]
    if rope is not None:
        _check_rope(rope, num_decodes, num_kv_heads, head_dim, query.dtype)
        rope_args = (
            rope.positions, rope.cos_sin, rope.key, rope.value, rope.slot_block,
            rope.slot_offset, *rope.cos_sin.stride(), *rope.key.stride(), *rope.value.stride(),
        )  # fmt: skip
    else:
        rope_args = (seq_lens,) * 6 + (0,) * 9  # unused pointers and strides
    norm = rope.norm if rope is not None else None
    if norm is not None:
        _check_norm(norm, num_decodes, num_heads + 2 * num_kv_heads, head_dim, query.dtype)
        hidden = norm.stream.shape[1]
        bias = norm.bias if norm.bias is not None else norm.stream
        norm_args = (
            norm.stream, norm.stream.stride(0), hidden, norm.eps,
            bias, bias[num_heads:], bias[num_heads + num_kv_heads:],
        )  # fmt: skip
    else:
        hidden = 1
        norm_args = (seq_lens, 0, 1, 0.0, seq_lens, seq_lens, seq_lens)  # unused
    group = num_heads // num_kv_heads
    bd = block_d(head_dim)
    default = decode_launch(head_dim, num_decodes, num_kv_heads, num_splits, out.device)
    tile_n = tile_n or default[0]
    num_warps = num_warps or default[1]
    num_stages = num_stages or default[2]
    if num_splits > 1:
        part_out = torch.empty(
            (num_decodes, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device
        )
        part_lse = torch.empty(
            (num_decodes, num_heads, num_splits), dtype=torch.float32, device=out.device
        )
    else:
        part_out = part_lse = out  # unused
    if fuse_reduce is None:
        fuse_reduce = FUSE_REDUCE
    fuse_reduce = fuse_reduce and num_splits > 1
    counters = (
        zeroed_counters(out.device, num_decodes * num_kv_heads, "decode_attention")
        if fuse_reduce
        else seq_lens
    )
    pdl = pdl_launch(out.device)
    row_bytes = head_dim * kv.element_size()
    prefetch = (
        PREFETCH_TILES * tile_n
        if num_splits > 1  # (one split a request: measured slower, see PREFETCH_TILES)
        and bulk_prefetch_ok(out.device)
        and kv.stride(4) == 1
        and kv.data_ptr() % 16 == 0
        and all(st * kv.element_size() % 16 == 0 for st in kv.stride()[:4])
        and row_bytes % 16 == 0
        else 0
    )
    launcher(_decode_kernel)(
        (num_decodes, num_kv_heads, num_splits),
        query,
        kv,
        out,
        part_out,
        part_lse,
        seq_lens,
        block_tables,
        counters,
        scale * kv_cache.k_scale * LOG2E,
        *query.stride(),
        *out.stride(),
        *kv.stride(),
        block_tables.stride(0),
        *rope_args,
        *norm_args,
        window,
        softcap * LOG2E,
        1.0 / kv_cache.k_scale,
        1.0 / kv_cache.v_scale,
        kv_cache.v_scale,
        ROPE=rope is not None,
        NORM=norm is not None,
        HAS_BIAS=norm is not None and norm.bias is not None,
        BLOCK_HID=next_pow2(hidden),
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=bd,
        BLOCK_SIZE=kv_cache.block_size,
        BLOCK_H=max(16, next_pow2(group)),
        TILE_N=tile_n,
        UPCAST=upcast_in_kernel(query),
        DOT_PREC=dot_precision(query.dtype),
        WINDOWED=window > 0,
        SOFTCAP=softcap > 0,
        FUSE_REDUCE=fuse_reduce,
        BLOCK_S=next_pow2(num_splits),
        UNROLL=min(COMBINE_UNROLL, num_splits),
        PREFETCH=prefetch,
        ROW_BYTES=row_bytes,
        EARLY=EARLY_INPUTS and num_splits > 1,
        KV_MAX=cache_max(kv.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl,
    )
    if num_splits > 1 and not fuse_reduce:
        launcher(_decode_reduce_kernel)(
            (num_decodes, num_kv_heads),
            part_out,
            part_lse,
            out,
            seq_lens,
            *out.stride(),
            window,
            NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits,
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_H=next_pow2(group),
            BLOCK_D=bd,
            BLOCK_S=next_pow2(num_splits),
            UNROLL=min(COMBINE_UNROLL, num_splits),
            TILE_N=tile_n,
            WINDOWED=window > 0,
            num_warps=2,
        )


def _check_rope(
    rope: DecodeRope, num_decodes: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    rows = (num_decodes, num_kv_heads, head_dim)
    for name in ("key", "value"):
        t = getattr(rope, name)
        if tuple(t.shape) != rows or t.dtype != dtype:
            raise ValueError(f"rope.{name} must be {list(rows)} {dtype}, not {tuple(t.shape)}")
    for name in ("positions", "slot_block", "slot_offset"):
        if tuple(getattr(rope, name).shape) != (num_decodes,):
            raise ValueError(f"rope.{name} must be [{num_decodes}]")
    cs = rope.cos_sin
    if cs.dim() != 3 or cs.shape[1] != 2 or cs.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"rope.cos_sin must be [max_positions, 2, {head_dim}]: {tuple(cs.shape)}")


def _check_norm(
    norm: DecodeNorm, num_decodes: int, qkv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    stream = norm.stream
    if stream.dim() != 2 or stream.shape[0] != num_decodes or stream.stride(1) != 1:
        raise ValueError(f"norm.stream must be [{num_decodes}, hidden], its rows dense")
    if stream.dtype != dtype:
        raise ValueError(f"norm.stream must be {dtype}, not {stream.dtype}")
    bias = norm.bias
    if bias is not None and (
        tuple(bias.shape) != (qkv_heads, head_dim) or not bias.is_contiguous()
    ):
        raise ValueError(f"norm.bias must be a contiguous [{qkv_heads}, {head_dim}]")


def ref_decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    kv_cache: KVCacheView,
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim] fp32
    """One request at a time in fp32 over its last ``window`` keys (all with 0; times the
    cache's scales), the scores capped by ``softcap`` (none with 0)."""
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    block_size = kv_cache.block_size
    group = query.shape[1] // kv_cache.kv.shape[3]
    for i, seq_len in enumerate(seq_lens):
        blocks = block_tables[i, : math.ceil(seq_len / block_size)]
        first = max(seq_len - window, 0) if window > 0 else 0
        k = kv_cache.key[blocks].flatten(0, 1)[first:seq_len].float() * kv_cache.k_scale
        v = kv_cache.value[blocks].flatten(0, 1)[first:seq_len].float() * kv_cache.v_scale
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", query[i].float(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out
