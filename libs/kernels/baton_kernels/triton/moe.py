# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""A mixture of experts' MLP as grouped GEMMs over the token-expert pairs (the approach of vLLM's
``fused_moe``), with static shapes and no host work, so that CUDA graphs hold it at any batch.

A step of ``T`` tokens routed to ``k`` experts each has ``P = T k`` pairs (pair ``p`` is token
``p // k``'s ``p % k``-th choice). ``align_pairs`` groups the pairs by expert into
blocks of ``BLOCK_M`` rows: each block holds pairs of one expert only, an expert's last block is
partly filled, and each block records its expert (-1: past the last block) and how many of its
rows are pairs. Up to ``ALIGN_ONE`` pairs it is one launch of one program: a histogram counts
the pairs by expert, and each pair takes its row from its expert's cursor (an atomic add: the
order of an expert's rows is the hardware's, which no output depends on, since each row of the
GEMMs is computed alone). Beyond, it takes two launches of several programs: each program
counts its share of the pairs by expert, then places them after the counts of the programs
before it, in their order. ``expert_gemm`` then runs one program per (block, column block):
it reads the block's rows of the input (the token's row for the first projection, the pair's
own row for the second) and its expert's weight tile, so each chosen expert's weights are read
once a column block whatever the number of its tokens, and an expert no token chose is never
read. Its output is one row a pair, optionally scaled by the pair's routing weight.

Up to ``GEMV_TOKENS`` tokens (a lone request's decode step) the pairs are too few for blocks:
``expert_gemv`` runs one program per (pair, column block), which reads its pair's expert from
the routing itself (no alignment), and the down projection computes SiLU-and-multiply of its
input as it loads it (no activation launch). An expert two pairs chose is read twice, once a
pair, mostly from the L2.

``route_top_k`` makes the choices from the router's logits (softmax, top k, renormalization) in
one launch. ``fused_experts`` chains the rest: gate/up projection, SiLU-and-multiply, down
projection scaled by the routing weights, and each token's ``k`` rows summed (``sum_pairs``, in
the order of its choices). The number of blocks launched is the most the routing can need,
``cdiv(P, BLOCK_M) + min(E, P)``; programs of blocks past the last return at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from baton_kernels.triton.common import (
    SUPPORTED_DTYPES,
    cdiv,
    dot_precision,
    next_pow2,
    upcast_in_kernel,
)
from baton_kernels.triton.gemv import _silu_mul
from baton_kernels.triton.launch import launcher

GEMV_TOKENS = 4  # at most this many tokens: the experts as GEMVs a pair, no alignment
GEMV_CONFIG = (16, 256, 4, 3)  # expert_gemv's (BLOCK_N, BLOCK_K, warps, stages)
ALIGN_TILE = 4096  # pairs x experts compared at once by align_pairs (its chunk's rows: this / E)
ALIGN_ONE = 4096  # at most this many pairs: align_pairs in one launch of one program
ALIGN_CHUNK = 1024  # pairs that one program counts or places at once
ALIGN_PAIRS = 256  # beyond ALIGN_ONE: the pairs a program places (more pairs, more programs)
# Tiles by the mean pairs an expert gets: (most mean rows, BLOCK_M, BLOCK_N, BLOCK_K, warps,
# stages); the last entry takes every larger mean. Measured on an H100 at Qwen3-30B-A3B's layer
# (benchmarks/RESULTS.md, 2026-12-06): the tiles tried are within 2% of each other up to a mean
# of 16; at a mean of 512 BLOCK_M 128 is 9% faster than 64, equal at 64.
GEMM_CONFIGS: list[tuple[float, int, int, int, int, int]] = [
    (16, 16, 64, 128, 4, 4),
    (48, 32, 64, 64, 4, 4),
    (128, 64, 128, 64, 8, 3),
    (float("inf"), 128, 128, 64, 8, 3),
]


class Alignment(NamedTuple):
    """The pairs grouped by expert (``align_pairs``)."""

    pairs: torch.Tensor  # [blocks * block_m] int32: the pair in each block's row
    block_expert: torch.Tensor  # [blocks] int32: each block's expert, -1 past the last block
    block_rows: torch.Tensor  # [blocks] int32: how many of a block's rows hold pairs
    block_m: int


@triton.jit
def _expert_hits(ids_ptr, p, num_pairs, E_P2: tl.constexpr):
    """``[len(p), E_P2]`` int32: 1 where pair ``p`` chose the expert of the column."""
    expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    return (expert[:, None] == tl.arange(0, E_P2)[None, :]).to(tl.int32)


@triton.jit
def _count_share(ids_ptr, first, per_program, num_pairs, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    """``[E_P2]``: the pairs ``first .. first + per_program`` (those below ``num_pairs``) of
    each expert."""
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for c0 in range(0, per_program, CHUNK):
        counts += tl.sum(_expert_hits(ids_ptr, first + c0 + tl.arange(0, CHUNK), num_pairs, E_P2),
                         axis=0)  # fmt: skip
    return counts


@triton.jit(do_not_specialize=["num_pairs", "per_program"])
def _count_kernel(
    ids_ptr,
    counts_ptr,  # [programs, E_P2]: each program's pairs of each expert
    num_pairs,
    per_program,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    g = tl.program_id(0)
    counts = _count_share(ids_ptr, g * per_program, per_program, num_pairs, E_P2, CHUNK)
    tl.store(counts_ptr + g * E_P2 + tl.arange(0, E_P2), counts)


@triton.jit
def _describe_blocks(
    block_expert_ptr, block_rows_ptr, counts, block_start, block_end, first, how_many,
    num_blocks, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, B_CHUNK: tl.constexpr,
):  # fmt: skip
    """Each block's expert (-1 past the last) and rows in use, blocks ``first ..
    first + how_many`` (those below ``num_blocks``), from the experts' pair ``counts`` and
    their first and past-the-last blocks."""
    e = tl.arange(0, E_P2)
    for b0 in range(0, how_many, B_CHUNK):
        b = first + b0 + tl.arange(0, B_CHUNK)
        # [B_CHUNK, E_P2]: the block's expert, if any
        inside = (block_start[None, :] <= b[:, None]) & (b[:, None] < block_end[None, :])
        inside = inside.to(tl.int32)
        owner = tl.sum(inside * (e[None, :] + 1), axis=1) - 1
        left = tl.sum(inside * (counts[None, :] - (b[:, None] - block_start[None, :]) * BLOCK_M),
                      axis=1)  # fmt: skip
        ok = b < num_blocks
        tl.store(block_expert_ptr + b, owner, mask=ok)
        tl.store(block_rows_ptr + b, tl.minimum(left, BLOCK_M), mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_one_kernel(
    ids_ptr,  # [P] the expert of each pair
    cursor_ptr,  # [E_P2] scratch: each expert's next free row
    pairs_ptr,
    block_expert_ptr,
    block_rows_ptr,
    num_pairs,
    num_blocks,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,  # pairs counted or placed at once
    B_CHUNK: tl.constexpr,
):
    e = tl.arange(0, E_P2)
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        counts += tl.histogram(tl.load(ids_ptr + p, mask=p < num_pairs, other=0).to(tl.int32),
                               E_P2)  # fmt: skip
    # (the loads past the last pair counted as expert 0's)
    counts -= tl.where(e == 0, tl.cdiv(num_pairs, CHUNK) * CHUNK - num_pairs, 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    block_start = block_end - blocks
    tl.store(cursor_ptr + e, block_start * BLOCK_M)
    tl.debug_barrier()  # (every thread's cursors stored before any is taken)
    for c0 in range(0, num_pairs, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        ok = p < num_pairs
        expert = tl.load(ids_ptr + p, mask=ok, other=0).to(tl.int32)
        row = tl.atomic_add(cursor_ptr + expert, 1, mask=ok, sem="relaxed", scope="cta")
        tl.store(pairs_ptr + row, p, mask=ok)
    _describe_blocks(block_expert_ptr, block_rows_ptr, counts, block_start, block_end, 0,
                     num_blocks, num_blocks, E_P2, BLOCK_M, B_CHUNK)  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "per_program", "blocks_per_program"])
def _align_kernel(
    ids_ptr,  # [P] the expert of each pair
    counts_ptr,  # [programs, E_P2] (COUNTED)
    pairs_ptr,  # [blocks * BLOCK_M]
    block_expert_ptr,  # [blocks]
    block_rows_ptr,  # [blocks]
    num_pairs,
    num_blocks,
    per_program,  # pairs a program places (a multiple of CHUNK)
    blocks_per_program,  # blocks a program describes (a multiple of B_CHUNK)
    E_P2: tl.constexpr,  # the experts, padded to a power of two
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,  # pairs compared with every expert at once
    B_CHUNK: tl.constexpr,  # blocks compared with every expert at once
    G_CHUNK: tl.constexpr,  # rows of counts_ptr summed at once
    COUNTED: tl.constexpr,  # _count_kernel counted each program's pairs (else: one program)
):
    g = tl.program_id(0)
    e = tl.arange(0, E_P2)
    first = g * per_program
    earlier = tl.zeros((E_P2,), dtype=tl.int32)  # the earlier programs' pairs of each expert
    if COUNTED:
        counts = tl.zeros((E_P2,), dtype=tl.int32)  # every pair's
        for r0 in range(0, tl.num_programs(0), G_CHUNK):
            r = r0 + tl.arange(0, G_CHUNK)
            rows = tl.load(counts_ptr + r[:, None] * E_P2 + e[None, :],
                           mask=(r < tl.num_programs(0))[:, None], other=0)  # fmt: skip
            counts += tl.sum(rows, axis=0)
            earlier += tl.sum(tl.where((r < g)[:, None], rows, 0), axis=0)
    else:  # (one program: its share is every pair)
        counts = _count_share(ids_ptr, 0, per_program, num_pairs, E_P2, CHUNK)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    block_start = block_end - blocks
    # each pair's row: its expert's first row + the pairs of that expert before it
    seen = block_start * BLOCK_M + earlier
    for c0 in range(0, per_program, CHUNK):
        p = first + c0 + tl.arange(0, CHUNK)
        hit = _expert_hits(ids_ptr, p, num_pairs, E_P2)  # [CHUNK, E_P2], one hit a pair
        before = tl.cumsum(hit, axis=0) - hit
        row = tl.sum(hit * (before + seen[None, :]), axis=1)
        tl.store(pairs_ptr + row, p, mask=p < num_pairs)
        seen += tl.sum(hit, axis=0)
    _describe_blocks(block_expert_ptr, block_rows_ptr, counts, block_start, block_end,
                     g * blocks_per_program, blocks_per_program, num_blocks, E_P2, BLOCK_M,
                     B_CHUNK)  # fmt: skip


@triton.jit(do_not_specialize=["num_experts"])
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_t,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    E_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, E_P2)
    x = tl.load(logits_ptr + t * stride_t + cols, mask=cols < num_experts, other=float("-inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = e / tl.sum(e, axis=0)
    probs = tl.where(cols < num_experts, probs, -1.0)  # (below every probability)
    slots = tl.arange(0, K_P2)
    chosen = tl.zeros([K_P2], dtype=tl.float32)
    chosen_ids = tl.zeros([K_P2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        at = tl.min(tl.where(probs == best, cols, E_P2), axis=0)  # (the first of equals)
        at = tl.minimum(at, num_experts - 1)  # (NaN logits match nothing: an id in range still)
        chosen = tl.where(slots == j, best, chosen)
        chosen_ids = tl.where(slots == j, at, chosen_ids)
        probs = tl.where(cols == at, -2.0, probs)
    if RENORMALIZE:
        chosen = chosen / tl.sum(tl.where(slots < TOP_K, chosen, 0.0), axis=0)
    tl.store(weights_ptr + t * TOP_K + slots, chosen, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, chosen_ids.to(tl.int64), mask=slots < TOP_K)


def route_top_k(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for each token from its logits ``[T, E]``, in one launch:
    ``(weights, ids)``, both ``[T, top_k]``, the ``top_k`` largest softmax probabilities
    (computed in float32, as transformers) in decreasing order, renormalized to sum to 1 when
    ``renormalize``, in the logits' dtype; ids int64. Equal probabilities go to the lower id.
    The engine's ``baton_engine.models.moe.route`` is its plain-PyTorch form."""
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"cannot choose {top_k} of logits {tuple(logits.shape)}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {logits.dtype}")
    num_tokens, num_experts = logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    if num_tokens:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        launcher(_route_kernel)(
            (num_tokens,), logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
            K_P2=next_pow2(top_k), E_P2=next_pow2(num_experts), RENORMALIZE=renormalize,
            num_warps=1 if num_experts <= 256 else 4,
        )  # fmt: skip
    return weights, ids


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks ``num_pairs`` pairs can fill: every expert's last block may be partial."""
    return cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Group the pairs of ``ids`` (``[T, k]``, each below ``num_experts``) by expert in blocks
    of ``block_m`` rows (the module's docstring). Pairs of one expert keep their order beyond
    ``ALIGN_ONE`` pairs only."""
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be [tokens, top_k] integers: {tuple(ids.shape)} {ids.dtype}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16: {block_m}")
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    block_rows = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    if blocks and num_pairs <= ALIGN_ONE:
        e_p2 = next_pow2(num_experts)
        launcher(_align_one_kernel)(
            (1,), flat, torch.empty(e_p2, dtype=torch.int32, device=ids.device), pairs,
            block_expert, block_rows, num_pairs, blocks, E_P2=e_p2, BLOCK_M=block_m,
            CHUNK=min(ALIGN_CHUNK, next_pow2(num_pairs)),
            B_CHUNK=max(1, min(ALIGN_TILE // e_p2, next_pow2(blocks))), num_warps=4,
        )  # fmt: skip
    elif blocks:
        e_p2 = next_pow2(num_experts)
        chunk = max(1, min(ALIGN_TILE // e_p2, next_pow2(num_pairs)))
        b_chunk = max(1, min(ALIGN_TILE // e_p2, next_pow2(blocks)))
        programs = cdiv(num_pairs, ALIGN_PAIRS)
        per_program = cdiv(cdiv(num_pairs, programs), chunk) * chunk
        programs = cdiv(num_pairs, per_program)
        counts = pairs  # (unread with one program)
        if programs > 1:
            counts = torch.empty((programs, e_p2), dtype=torch.int32, device=ids.device)
            launcher(_count_kernel)(
                (programs,), flat, counts, num_pairs, per_program, E_P2=e_p2, CHUNK=chunk,
                num_warps=4,
            )  # fmt: skip
        launcher(_align_kernel)(
            (programs,),
            flat,
            counts,
            pairs,
            block_expert,
            block_rows,
            num_pairs,
            blocks,
            per_program,
            cdiv(cdiv(blocks, programs), b_chunk) * b_chunk,
            E_P2=e_p2,
            BLOCK_M=block_m,
            CHUNK=chunk,
            B_CHUNK=b_chunk,
            G_CHUNK=max(1, min(ALIGN_TILE // e_p2, next_pow2(programs))),
            COUNTED=programs > 1,
            num_warps=4,
        )
    return Alignment(pairs, block_expert, block_rows, block_m)


@triton.jit
def _expert_gemm_kernel(
    a_ptr,  # [rows, K]: a token's row (GATHER) or a pair's
    w_ptr,  # [E, N, K]
    out_ptr,  # [P, N]: a pair's row
    pairs_ptr,
    block_expert_ptr,
    block_rows_ptr,
    route_ptr,  # [P] each pair's routing weight (ROUTE)
    N,
    K,
    s_a,
    s_we,
    s_wn,
    s_o,
    TOP_K: tl.constexpr,
    GATHER: tl.constexpr,  # a's rows are tokens: pair p reads row p // TOP_K
    ROUTE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,  # the interpreter: no 16-bit float math
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    r = tl.arange(0, BLOCK_M)
    r_ok = r < tl.load(block_rows_ptr + block)
    pair = tl.load(pairs_ptr + block * BLOCK_M + r, mask=r_ok, other=0)
    row = pair // TOP_K if GATHER else pair
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_base = w_ptr + expert.to(tl.int64) * s_we + n[None, :].to(tl.int64) * s_wn
    a_base = a_ptr + row[:, None].to(tl.int64) * s_a
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_base + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PREC)
    if ROUTE:
        acc *= tl.load(route_ptr + pair, mask=r_ok, other=0.0).to(tl.float32)[:, None]
    ok = r_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + pair[:, None].to(tl.int64) * s_o + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=ok)  # fmt: skip


def _pairs_out(
    a: torch.Tensor,
    w: torch.Tensor,
    num_pairs: int,
    top_k: int | None,
    route: torch.Tensor | None,
    a_width: int,
) -> torch.Tensor:
    """The ``[P, N]`` output of ``expert_gemm`` or ``expert_gemv`` for ``w`` ``[E, N, K]``,
    once their inputs are checked (``a``: ``[rows, a_width]``)."""
    if a.dim() != 2 or w.dim() != 3 or a.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError(f"a must be [rows, K] and w [E, N, K], rows dense: {a.shape}, {w.shape}")
    if a.shape[1] != a_width or a.dtype != w.dtype or a.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"a {tuple(a.shape)} {a.dtype} does not fit w {tuple(w.shape)} {w.dtype}")
    if a.shape[0] * (top_k or 1) != num_pairs:
        raise ValueError(f"a has {a.shape[0]} rows for {num_pairs} pairs (top_k {top_k})")
    if route is not None and route.shape != (num_pairs,):
        raise ValueError(f"route must be [{num_pairs}]: {tuple(route.shape)}")
    return torch.empty((num_pairs, w.shape[1]), dtype=a.dtype, device=a.device)


def gemm_config(num_pairs: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)`` for ``num_pairs`` pairs over
    ``num_experts`` experts (``GEMM_CONFIGS``, by the mean pairs an expert gets)."""
    mean = num_pairs / max(num_experts, 1)
    _, *tile = next((c for c in GEMM_CONFIGS if mean <= c[0]), GEMM_CONFIGS[-1])
    block_m, block_n, block_k, warps, stages = tile
    return block_m, block_n, block_k, warps, stages


def expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    align: Alignment,
    num_pairs: int,
    top_k: int | None = None,
    route: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``out[p] = a[row(p)] @ w[expert(p)].T`` (times ``route[p]`` when given) for each of the
    ``num_pairs`` pairs of ``align``: ``[P, N]`` for ``w`` ``[E, N, K]``. ``row(p)`` is
    ``p // top_k`` (``a`` holds the tokens' rows) or, without ``top_k``, ``p`` (a pair's own).
    Float32 accumulation, one rounding to ``a``'s dtype."""
    out = _pairs_out(a, w, num_pairs, top_k, route, w.shape[-1])
    num_experts, n_out, k_in = w.shape
    if num_pairs == 0 or n_out == 0:
        return out
    block_m, block_n, block_k, warps, stages = config or gemm_config(num_pairs, num_experts)
    if block_m != align.block_m:
        raise ValueError(f"align's blocks have {align.block_m} rows, the GEMM's {block_m}")
    launcher(_expert_gemm_kernel)(
        (align.block_expert.numel(), cdiv(n_out, block_n)),
        a,
        w,
        out,
        align.pairs,
        align.block_expert,
        align.block_rows,
        route if route is not None else out,
        n_out,
        k_in,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        TOP_K=top_k or 1,
        GATHER=top_k is not None,
        ROUTE=route is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, max(16, next_pow2(k_in))),
        DOT_PREC=dot_precision(a.dtype),
        UPCAST=upcast_in_kernel(a),
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton.jit
def _expert_gemv_kernel(
    a_ptr,  # [rows, K] (or [rows, 2K]: gate, up with SILU_MUL)
    w_ptr,  # [E, N, K]
    out_ptr,  # [P, N]
    ids_ptr,  # [P] each pair's expert
    route_ptr,  # [P] (ROUTE)
    N,
    K,
    s_a,
    s_we,
    s_wn,
    s_o,
    TOP_K: tl.constexpr,
    GATHER: tl.constexpr,
    ROUTE: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (p, j): pair p's columns block j, on the CUDA cores: the products summed lane
    by lane over K, across the lanes once at the end."""
    p = tl.program_id(0)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    row = p // TOP_K if GATHER else p
    a_row = a_ptr + row.to(tl.int64) * s_a
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + expert * s_we + n[:, None].to(tl.int64) * s_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_row + k, mask=k_ok, other=0.0)
        if SILU_MUL:  # (rounded as the activation's own kernel stores it)
            a = _silu_mul(a, tl.load(a_row + K + k, mask=k_ok, other=0.0), 1.0, 2)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if ROUTE:
        y *= tl.load(route_ptr + p).to(tl.float32)
    tl.store(out_ptr + p.to(tl.int64) * s_o + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def expert_gemv(
    a: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    top_k: int | None = None,
    route: torch.Tensor | None = None,
    silu_mul: bool = False,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``expert_gemm``'s result for a few pairs without their alignment: ``out[p] =
    a'[row(p)] @ w[ids[p]].T`` (times ``route[p]`` when given) for each pair ``p`` of ``ids``
    (``[P]``, or ``[T, k]`` flattened), ``[P, N]`` for ``w`` ``[E, N, K]``; ``row(p)`` as
    there. ``a'`` is ``a``, or with ``silu_mul`` SiLU(gate) * up of ``a`` ``[rows, 2K]``'s
    halves, rounded to its dtype (as ``fused_ops.silu_and_mul`` stores it). Float32
    accumulation, one rounding to ``a``'s dtype. ``config``: ``(BLOCK_N, BLOCK_K, warps,
    stages)``, default ``GEMV_CONFIG``."""
    flat = ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be integers: {flat.dtype}")
    num_pairs = flat.numel()
    out = _pairs_out(a, w, num_pairs, top_k, route, (2 if silu_mul else 1) * w.shape[-1])
    _, n_out, k_in = w.shape
    if num_pairs == 0 or n_out == 0:
        return out
    block_n, block_k, warps, stages = config or GEMV_CONFIG
    launcher(_expert_gemv_kernel)(
        (num_pairs, cdiv(n_out, block_n)), a, w, out, flat, route if route is not None else out,
        n_out, k_in, a.stride(0), w.stride(0), w.stride(1), out.stride(0), TOP_K=top_k or 1,
        GATHER=top_k is not None, ROUTE=route is not None, SILU_MUL=silu_mul, BLOCK_N=block_n,
        BLOCK_K=min(block_k, max(16, next_pow2(k_in))), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def fused_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' weighted sum for each token of ``x`` ``[T, H]`` routed to ``ids`` with
    ``weights`` (``[T, k]``): ``[T, H]``, for stacked ``gate_up`` ``[E, 2I, H]`` and ``down``
    ``[E, H, I]``; ``act`` maps ``[P, 2I]`` to ``[P, I]``; ``None``: SiLU-and-multiply by
    these kernels (``fused.silu_and_mul``'s, or inside the down projection's loads up to
    ``GEMV_TOKENS`` tokens). ``residual`` and ``out``: added to the residual in the last
    kernel (``sum_pairs``)."""
    num_tokens, top_k = ids.shape
    if x.dim() != 2 or x.shape[0] != num_tokens or weights.shape != ids.shape:
        raise ValueError(f"x {tuple(x.shape)}, ids {tuple(ids.shape)} and weights "
                         f"{tuple(weights.shape)} do not match")  # fmt: skip
    num_pairs, num_experts = num_tokens * top_k, gate_up.shape[0]
    route = weights.reshape(-1)
    if num_tokens <= GEMV_TOKENS:
        hidden = expert_gemv(x, gate_up, ids, top_k=top_k)
        if act is not None:
            hidden = act(hidden)
        pairs = expert_gemv(hidden, down, ids, route=route, silu_mul=act is None)
    else:
        from baton_kernels.fused import silu_and_mul

        config = gemm_config(num_pairs, num_experts)
        align = align_pairs(ids, num_experts, config[0])
        hidden = expert_gemm(x, gate_up, align, num_pairs, top_k=top_k, config=config)
        hidden = (act or silu_and_mul)(hidden)
        pairs = expert_gemm(hidden, down, align, num_pairs, route=route, config=config)
    return sum_pairs(pairs.view(num_tokens, top_k, -1), residual, out)


@triton.jit
def _sum_pairs_kernel(
    x_ptr, res_ptr, out_ptr, H, TOP_K: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # (the sum rounded first: what adding the rounded sum to the residual gives)
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.load(res_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_pairs(
    x: torch.Tensor, residual: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each token's rows summed, ``x`` ``[T, k, H]`` (contiguous) to ``[T, H]``: in float32,
    in the order of its choices, rounded once (as torch's ``x.sum(dim=1)``), in one launch
    (torch's reduction took ~5.6 us a layer at one token on an H100, RESULTS). With
    ``residual`` (``[T, H]``, contiguous; ``out`` may be it, updated in place) the rounded sum
    is added to it, as ``residual + x.sum(dim=1)`` rounds."""
    num_tokens, top_k, hidden = x.shape
    if not x.is_contiguous():
        raise ValueError(f"sum_pairs: x must be contiguous: strides {x.stride()}")
    for t, what in ((residual, "residual"), (out, "out")):
        if t is not None and (t.shape != (num_tokens, hidden) or not t.is_contiguous()
                              or t.dtype != x.dtype):  # fmt: skip
            raise ValueError(f"sum_pairs: {what} must be a contiguous [{num_tokens}, {hidden}] "
                             f"{x.dtype} tensor")  # fmt: skip
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens and hidden:
        block = min(1024, next_pow2(hidden))
        launcher(_sum_pairs_kernel)(
            (num_tokens, cdiv(hidden, block)), x, residual if residual is not None else x, out,
            hidden, TOP_K=top_k, HAS_RES=residual is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def ref_fused_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``fused_experts`` in plain PyTorch, a pair at a time, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = act((x[t].float() @ gate_up[e].float().t())[None])[0]
            out[t] += float(weights[t, j]) * (h @ down[e].float().t())
    return out.to(x.dtype)
