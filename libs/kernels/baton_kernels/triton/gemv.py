# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""Linear layers of a few rows (batch-1 decode) with the elementwise op before or after them in
the same launch.

``gemv(x, weight)`` is ``x @ weight.T`` for ``x`` ``[M, K]``, M at most ``MAX_ROWS``, reading
``weight`` ``[N, K]`` once for all rows. Optionally, in the same kernel:

- before: RMSNorm of each row of ``x`` (``norm_weight``; the normed row is not rounded to
  ``x``'s dtype, where the separate norm kernel rounds it), or SiLU-and-multiply of ``x``
  ``[M, 2K]`` (``silu_mul``, rounded as the separate kernel rounds it);
- after: ``+ bias`` and ``+ residual`` (which may be ``out`` itself: each program reads and
  writes only its own columns).

At batch 1 a decode layer is memory-bound weight reads with small kernels between them; these
launches take the norm and SiLU kernels and the residual add out of the graph (a layer runs 6
kernels instead of 9). Each program computes its columns over the whole of K, so every program
reads the (small) input rows in full, from L2, and computes a norm's sum of squares itself.

Three kernels do the work: ``_gemv_kernel`` (one program a column block) and
``_gemv_stream_kernel`` (a fixed grid) on the CUDA cores, each waiting for every slice it
loads; ``_gemv_dot_kernel`` on the tensor cores, whose weight tiles Triton's software pipeline
keeps in flight through shared memory, optionally with K split over several programs a column
block (the long weights of a large model: ``DOT_LAUNCHES``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from baton_kernels.triton.common import (
    SUPPORTED_DTYPES,
    bulk_prefetch_ok,
    cdiv,
    dot_precision,
    next_pow2,
    num_sms,
    pdl_launch,
    prefetch_rows_l2,
    upcast_in_kernel,
    zeroed_counters,
)
from baton_kernels.triton.launch import launcher

MAX_ROWS = 4
PRO_NONE, PRO_RMS_NORM, PRO_SILU_MUL, PRO_SILU_MUL_NORMED = 0, 1, 2, 3
DEFAULT_CONFIG = (16, 256, 4, 4)  # (columns per program, K per iteration, warps, stages)
PREFETCH = True  # the default of gemv's prefetch
STREAM = int(os.environ.get("BATON_GEMV_STREAM", "0"))  # the default of gemv's stream
# (N, K) -> the tensor-core kernel's launch (gemv's ``dot``) for the weights of that shape: each
# the best of a one-row sweep on an H200 where it beat what the engine ran before
# (``benchmarks/device/ab_gemv_dot.sh``; GB/s of weight read, graph-timed): Llama-3.1-8B's o_proj
# 2,927 against the fixed grid's 2,657, gate_up 3,888 against cuBLAS's 3,835, down (SiLU and the
# folded norm inside) 3,135 against 2,936. The 32-layer stack without attention: 3,719 us
# against 3,835; the engine's batch-1 graph 4.083 ms against 4.234, 4.041 with DOT_PREFETCH 1
# (229.6-234.4 tok/s in four processes against 221.2-221.3 on the CUDA cores). Its qkv
# projection (the input norm inside) read slower there alone (3,026 against the CUDA-core
# kernel's 3,081), but in the engine it gains: graph 3.999-4.007 ms against 4.047-4.059,
# 233.2-234.3 tok/s against 229.2-230.8 in three pairs of processes (ab_wide_head.sh,
# ab_qkv_dot.sh; thirty-second session).
DOT_LAUNCHES: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (6144, 4096): (64, 256, 4, 4, 1),
    (4096, 4096): (64, 256, 4, 4, 2),
    (28672, 4096): (256, 128, 8, 3, 1),
    (4096, 14336): (128, 128, 8, 4, 4),
}
# The weight dtypes DOT_LAUNCHES applies to: float32 would run the MMA's exact (slow) emulation
DOT_DTYPES = (torch.bfloat16, torch.float16)
# K slices the tensor-core kernel starts into the L2 before its PDL wait (stack: 3,702 us
# against 3,720 without, 3,752 with 2)
DOT_PREFETCH = 1


def dot_launch(weight: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """The tensor-core kernel's launch ``gemv`` takes for ``weight`` when not told one:
    ``DOT_LAUNCHES``' entry for its shape, for a weight of one of ``DOT_DTYPES``."""
    if weight.dtype not in DOT_DTYPES:
        return None
    return DOT_LAUNCHES.get((weight.shape[0], weight.shape[1]))


def choose_config(n: int, k: int) -> tuple[int, int, int, int]:
    """A launch configuration for a weight of ``n`` x ``k``, fitted to a one-row sweep on an
    H200 (``benchmarks/bench_gemv_gpu.py --sweep``, bf16, the projections of Qwen2.5-0.5B and
    Llama-3.1-8B): each pick is the best there or within 3% of it."""
    if k >= 4096 and n <= 4096:  # a down projection: long rows
        return (4, 2048, 8, 3)
    if n >= 8192:  # a gate/up projection: many short rows
        return (16, 256, 4, 4)
    if n <= 1024:
        return (2, 2048, 4, 2)
    return (4, 1024, 4, 2)


def choose_launch(n: int, k: int) -> tuple[tuple[int, int, int, int], int]:
    """The launch ``gemv`` uses for a weight of ``n`` x ``k`` when not told: a configuration and
    the programs per SM of the fixed-grid kernel (0: ``_gemv_kernel``, one program a column
    block). From a one-row sweep of both kernels on an H200 (``bench_gemv_gpu.py
    --stream-sweep``): the fixed grid won only at Llama-3.1-8B's o_proj, 4,096 x 4,096 (2,564
    GB/s, 4 programs an SM, against 2,486; the engine's batch-1 graph 4.230 ms against 4.271)
    and at its down projection (3,133 against 2,802, 3 programs an SM; the engine runs it so,
    SiLU-and-multiply inside, ``model_runner.GEMV_DOWN``); at every other projection of it and of
    Qwen2.5-0.5B the one-program-a-block launch was faster."""
    if n == k and n >= 4096:  # a large model's o_proj
        return (4, 1024, 4, 1), 4
    if n >= 4096 and k >= 3 * n:  # a large model's down projection
        return (16, 512, 8, 1), 3
    return choose_config(n, k), STREAM


@triton.jit
def _x_slice(x_rows, norm_ptr, kk, k_ok, m_ok, K, PROLOGUE: tl.constexpr):
    """Issue the loads of a K slice of the input rows (gate and up with SiLU) and of the norm
    weight (RMSNorm)."""
    mk = m_ok[:, None] & k_ok[None, :]
    xa = tl.load(x_rows + kk[None, :], mask=mk, other=0.0)
    xb = tl.load(x_rows + K + kk[None, :], mask=mk, other=0.0) if PROLOGUE >= 2 else xa
    nw = tl.load(norm_ptr + kk, mask=k_ok, other=0.0) if PROLOGUE == 1 else kk
    return xa, xb, nw


@triton.jit
def _silu_mul(gate, up, scale, PROLOGUE: tl.constexpr):
    """SiLU(gate) * up, rounded to their dtype; with ``PRO_SILU_MUL_NORMED`` gate and up are
    first scaled by ``scale`` (each row's 1/rms, broadcastable to them) and rounded, as
    ``fused_ops.silu_and_mul(norm_of=)`` does."""
    if PROLOGUE == 3:
        gate = (gate.to(tl.float32) * scale).to(up.dtype)
        up = (up.to(tl.float32) * scale).to(up.dtype)
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _gemv_compute(acc, ss, w, xa, xb, nw, rstd, PROLOGUE: tl.constexpr):
    """``acc`` += the slice of the (prologue'd) rows times ``w`` lane by lane; ``ss``
    accumulates the RMSNorm prologue's sums of squares. With SiLU, gate and up are first
    scaled by each row's ``rstd`` (``PRO_SILU_MUL_NORMED``) and rounded, as
    ``fused_ops.silu_and_mul(norm_of=)`` does, and the product is rounded as it stores it."""
    if PROLOGUE >= 2:  # SiLU(gate) * up
        xk = _silu_mul(xa, xb, rstd[:, None], PROLOGUE).to(tl.float32)
    else:
        xk = xa.to(tl.float32)
        if PROLOGUE == 1:
            ss += xk * xk
            xk = xk * nw.to(tl.float32)[None, :]
    acc += xk[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc, ss


@triton.jit
def _gemv_step(acc, ss, x_rows, norm_ptr, w, kk, K, m_ok, rstd, PROLOGUE: tl.constexpr):
    """One K slice of ``_gemv_kernel``: ``acc`` += the slice of the (prologue'd) rows times
    ``w`` lane by lane; ``ss`` accumulates the RMSNorm prologue's sums of squares. (Its own
    loads and arithmetic, as before ``_gemv_compute`` was written for the fixed-grid kernel:
    the compiled code of the measured launches stays the same.)"""
    k_ok = kk < K
    mk = m_ok[:, None] & k_ok[None, :]
    if PROLOGUE >= 2:  # SiLU(gate) * up, gate and up the two halves of each row
        if PROLOGUE == 3:  # scaled by the folded norm's 1/rms and rounded first
            gate = tl.load(x_rows + kk[None, :], mask=mk, other=0.0)
            up = tl.load(x_rows + K + kk[None, :], mask=mk, other=0.0)
            gate = (gate.to(tl.float32) * rstd[:, None]).to(gate.dtype).to(tl.float32)
            up = (up.to(tl.float32) * rstd[:, None]).to(up.dtype).to(tl.float32)
        else:
            gate = tl.load(x_rows + kk[None, :], mask=mk, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + kk[None, :], mask=mk, other=0.0).to(tl.float32)
        xk = gate / (1.0 + tl.exp(-gate)) * up
        xk = xk.to(x_rows.dtype.element_ty).to(tl.float32)
    else:
        xk = tl.load(x_rows + kk[None, :], mask=mk, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            ss += xk * xk
            xk = xk * tl.load(norm_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    acc += xk[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc, ss


@triton.jit
def _rows_rstd(ptr, s_m, offs_m, m_ok, H, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``1 / rms`` of rows ``offs_m`` of ``ptr`` ``[M, H]`` (``eps`` inside the root), float32;
    1 where there is no such row."""
    sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for h0 in range(0, H, BLOCK_K):
        hh = h0 + tl.arange(0, BLOCK_K)
        v = tl.load(ptr + offs_m[:, None] * s_m + hh[None, :],
                    mask=m_ok[:, None] & (hh < H)[None, :], other=0.0).to(tl.float32)  # fmt: skip
        sq += v * v
    return tl.where(m_ok, tl.rsqrt(tl.sum(sq, axis=1) / H + eps), 1.0)


@triton.jit
def _rows_rstd_by_row(
    ptr, s_m, offs_m, M, H, eps, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``_rows_rstd`` one row at a time (``ROWS`` of them, each in slices of ``BLOCK_K``): for
    the tensor-core kernel, whose ``BLOCK_M`` is 16 for 1-4 rows (a ``[16, 4096]`` tile would
    hold 128 registers a thread there, one row's slice 32)."""
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    for r in tl.static_range(ROWS):
        sq = tl.zeros([BLOCK_K], tl.float32)
        for h0 in range(0, H, BLOCK_K):
            hh = h0 + tl.arange(0, BLOCK_K)
            v = tl.load(ptr + r * s_m + hh, mask=(hh < H) & (r < M), other=0.0).to(tl.float32)
            sq += v * v
        rstd = tl.where((offs_m == r) & (r < M), tl.rsqrt(tl.sum(sq) / H + eps), rstd)
    return rstd


@triton.jit
def _gemv_epilogue(
    acc, ss, offs_m, offs_n, m_ok, n_ok, K, eps, bias_ptr, res_ptr, out_ptr, s_rm, s_om,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """Sum a column block's lanes, apply the norm's 1/rms, add the bias and the residual,
    store."""
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if PROLOGUE == 1:
        y *= (1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps))[:, None]
    _gemv_store(y, offs_m, offs_n, m_ok, n_ok, bias_ptr, res_ptr, out_ptr, s_rm, s_om, HAS_BIAS,
                HAS_RES)  # fmt: skip


@triton.jit
def _gemv_store(
    y, offs_m, offs_n, m_ok, n_ok, bias_ptr, res_ptr, out_ptr, s_rm, s_om,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """Add the bias and the residual to the float32 ``y`` ``[BLOCK_M, BLOCK_N]``, store."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    mn = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        res = tl.load(res_ptr + offs_m[:, None] * s_rm + offs_n[None, :], mask=mn, other=0.0)
        y += res.to(tl.float32)
    tl.store(
        out_ptr + offs_m[:, None] * s_om + offs_n[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=mn,
    )


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] (or [M, 2K] with SILU_MUL)
    w_ptr,  # [N, K]
    bias_ptr,  # [N]
    norm_ptr,  # [K]
    res_ptr,  # [M, N]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    s_xm,
    s_wn,
    s_rm,
    s_om,
    eps,
    nrm_ptr,  # [M, H]: the rows whose 1/rms scales gate and up (PRO_SILU_MUL_NORMED)
    s_nm,
    H,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * s_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + offs_n[:, None] * s_wn  # [BLOCK_N, 1]
    # Products are summed lane by lane over the K loop and across lanes once at the end. An
    # RMSNorm prologue scales by the norm weight in the loop and by each row's 1/rms at the
    # end (the sum of squares comes from the same loads): no pass over x before the weights.
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    ss = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    k_start = 0
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if PREFETCH:
        # the weights are no kernel's output: the first slice is read before the wait for
        # the previous kernel (under PDL, while it drains)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if PROLOGUE == 3:
            rstd = _rows_rstd(nrm_ptr, s_nm, offs_m, m_ok, H, eps, BLOCK_M, BLOCK_K)
        acc, ss = _gemv_step(acc, ss, x_rows, norm_ptr, w, offs_k, K, m_ok, rstd, PROLOGUE)
        k_start = BLOCK_K
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        if PROLOGUE == 3:
            rstd = _rows_rstd(nrm_ptr, s_nm, offs_m, m_ok, H, eps, BLOCK_M, BLOCK_K)
    for k0 in range(k_start, K, BLOCK_K):
        kk = k0 + offs_k
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
        acc, ss = _gemv_step(acc, ss, x_rows, norm_ptr, w, kk, K, m_ok, rstd, PROLOGUE)
    _gemv_epilogue(acc, ss, offs_m, offs_n, m_ok, n_ok, K, eps, bias_ptr, res_ptr, out_ptr,
                   s_rm, s_om, PROLOGUE, HAS_BIAS, HAS_RES)  # fmt: skip


@triton.jit
def _stream_slice(
    x_rows, w_ptr, norm_ptr, s_wn, it, total, k_iters, pid, grid, N, K, m_ok, offs_k,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr,
):  # fmt: skip
    """Issue the loads of step ``it`` of a program of ``_gemv_stream_kernel`` (nothing past
    ``total``): its weight slice, the input rows' slice (gate and up with SiLU) and the norm
    weight's."""
    j = it // k_iters
    offs_n = (pid + j * grid) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = (it - j * k_iters) * BLOCK_K + offs_k
    live = it < total
    n_ok = (offs_n < N) & live
    k_ok = (kk < K) & live
    w = tl.load(w_ptr + offs_n[:, None] * s_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0)  # fmt: skip
    xa, xb, nw = _x_slice(x_rows, norm_ptr, kk, k_ok, m_ok, K, PROLOGUE)
    return w, xa, xb, nw


@triton.jit
def _gemv_stream_kernel(
    x_ptr,  # [M, K] (or [M, 2K] with SILU_MUL)
    w_ptr,  # [N, K]
    bias_ptr,  # [N]
    norm_ptr,  # [K]
    res_ptr,  # [M, N]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    s_xm,
    s_wn,
    s_rm,
    s_om,
    eps,
    nrm_ptr,  # [M, H]: the rows whose 1/rms scales gate and up (PRO_SILU_MUL_NORMED)
    s_nm,
    H,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """``_gemv_kernel``'s work with a fixed grid (a few programs an SM): program ``p`` does the
    column blocks ``p, p + grid, ...``, each over all of K, in one flat loop over (column block,
    K slice). The loads of step ``i + 2`` are issued before step ``i``'s arithmetic (two slices
    in flight a program: Triton does not pipeline loads that feed no ``tl.dot``), and no
    program ends while others start (no tail of waves)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    x_rows = x_ptr + offs_m[:, None] * s_xm  # [BLOCK_M, 1]
    k_iters = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, grid) * k_iters
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    ss = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if PROLOGUE == 3:
        rstd = _rows_rstd(nrm_ptr, s_nm, offs_m, m_ok, H, eps, BLOCK_M, BLOCK_K)
    a = _stream_slice(x_rows, w_ptr, norm_ptr, s_wn, 0, total, k_iters, pid, grid, N, K, m_ok,
                      offs_k, BLOCK_N, BLOCK_K, PROLOGUE)  # fmt: skip
    b = _stream_slice(x_rows, w_ptr, norm_ptr, s_wn, 1, total, k_iters, pid, grid, N, K, m_ok,
                      offs_k, BLOCK_N, BLOCK_K, PROLOGUE)  # fmt: skip
    for it in range(0, total):
        c = _stream_slice(x_rows, w_ptr, norm_ptr, s_wn, it + 2, total, k_iters, pid, grid, N,
                          K, m_ok, offs_k, BLOCK_N, BLOCK_K, PROLOGUE)  # fmt: skip
        acc, ss = _gemv_compute(acc, ss, a[0], a[1], a[2], a[3], rstd, PROLOGUE)
        j = it // k_iters
        if it - j * k_iters == k_iters - 1:  # the block's last slice: its columns are done
            offs_n = (pid + j * grid) * BLOCK_N + tl.arange(0, BLOCK_N)
            _gemv_epilogue(acc, ss, offs_m, offs_n, m_ok, offs_n < N, K, eps, bias_ptr,
                           res_ptr, out_ptr, s_rm, s_om, PROLOGUE, HAS_BIAS, HAS_RES)  # fmt: skip
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
            ss = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        a = b
        b = c


@triton.jit
def _gemv_dot_kernel(
    x_ptr,  # [M, K] (or [M, 2K] with SILU_MUL)
    w_ptr,  # [N, K]
    bias_ptr,  # [N]
    norm_ptr,  # [K]
    res_ptr,  # [M, N]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    s_xm,
    s_wn,
    s_rm,
    s_om,
    eps,
    nrm_ptr,  # [M, H]: the rows whose 1/rms scales gate and up (PRO_SILU_MUL_NORMED)
    s_nm,
    H,
    part_ptr,  # [SPLIT_K, M, N] float32 partial sums, then [column blocks, SPLIT_K, M] sums
    # of squares (PRO_RMS_NORM)
    counter_ptr,  # [cdiv(N, BLOCK_N)] int32, zero between launches (SPLIT_K > 1)
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    RSTD_ROWS: tl.constexpr,
    RSTD_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr,  # weights (0: none)
    PREFETCH_BYTES: tl.constexpr,
    PDL: tl.constexpr,
):
    """``_gemv_kernel``'s work on the tensor cores: a column block's ``[BLOCK_N, BLOCK_K]``
    weight tile times the (prologue'd) input rows ``[BLOCK_K, BLOCK_M]`` (the rows padded to 16
    with zeros: the weight is the MMA's wide operand), so that Triton's software pipeline keeps
    ``num_stages`` weight tiles in flight through shared memory (it pipelines only the loads
    that feed a ``tl.dot``; the other kernels wait for each slice). The RMSNorm prologue
    rounds the normed slice to the weight's dtype (the MMA's operand). ``SPLIT_K`` programs a
    column block each take a K range; each stores its float32 partials and the last of them
    (an atomic count) sums them in order and finishes the block. ``PREFETCH``: the first that
    many weights of each of the program's rows are started into the L2 before the PDL wait
    (while the kernel before drains)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = split * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    x_cols = x_ptr + offs_m[None, :] * s_xm  # [1, BLOCK_M]
    w_rows = w_ptr + offs_n[:, None] * s_wn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    ss = tl.zeros([BLOCK_K, BLOCK_M], tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH > 0:  # the weights are no kernel's output: start the first slices into the L2
        ahead = k_lo + PREFETCH <= K  # (never past a row's end)
        prefetch_rows_l2(w_ptr + offs_n * s_wn + k_lo, n_ok & ahead, PREFETCH_BYTES)
    if PDL:
        tl.extra.cuda.gdc_wait()
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if PROLOGUE == 3:  # before the pipeline's first loads
        rstd = _rows_rstd_by_row(nrm_ptr, s_nm, offs_m, M, H, eps, BLOCK_M, RSTD_ROWS, RSTD_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_hi
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        mk = k_ok[:, None] & m_ok[None, :]
        xa = tl.load(x_cols + kk[:, None], mask=mk, other=0.0)  # [BLOCK_K, BLOCK_M]
        if PROLOGUE >= 2:  # SiLU(gate) * up, rounded
            up = tl.load(x_cols + K + kk[:, None], mask=mk, other=0.0)
            xb = _silu_mul(xa, up, rstd[None, :], PROLOGUE).to(w.dtype)
        elif PROLOGUE == 1:
            xf = xa.to(tl.float32)
            ss += xf * xf
            nw = tl.load(norm_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            xb = (xf * nw[:, None]).to(w.dtype)
        else:
            xb = xa.to(w.dtype)
        if UPCAST:  # the interpreter: no 16-bit float math
            acc = tl.dot(w.to(tl.float32), xb.to(tl.float32), acc, input_precision=DOT_PREC)
        else:
            acc = tl.dot(w, xb, acc, input_precision=DOT_PREC)
    y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    sq = tl.sum(ss, axis=0)  # [BLOCK_M]
    if SPLIT_K > 1:
        mn = m_ok[:, None] & n_ok[None, :]
        tl.store(part_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :], y, mask=mn)
        sq_ptr = part_ptr + SPLIT_K * M * N + pid * SPLIT_K * M  # this block's [SPLIT_K, M]
        if PROLOGUE == 1:
            tl.store(sq_ptr + split * M + offs_m, sq, mask=m_ok)
        # every thread's partials are stored before the release of the count; the last
        # program's acquire makes all of them visible to it (read past L1: ".cg")
        tl.debug_barrier()
        counter = counter_ptr + pid
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tl.debug_barrier()
            tl.store(counter, 0)
            y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            sq = tl.zeros([BLOCK_M], tl.float32)
            for s in range(SPLIT_K):  # in order: the sum does not depend on who came last
                y += tl.load(part_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :],
                             mask=mn, other=0.0, cache_modifier=".cg")  # fmt: skip
                if PROLOGUE == 1:
                    sq += tl.load(sq_ptr + s * M + offs_m, mask=m_ok, other=0.0,
                                  cache_modifier=".cg")  # fmt: skip
            if PROLOGUE == 1:
                y *= (1.0 / tl.sqrt(sq / K + eps))[:, None]
            _gemv_store(y, offs_m, offs_n, m_ok, n_ok, bias_ptr, res_ptr, out_ptr, s_rm, s_om,
                        HAS_BIAS, HAS_RES)  # fmt: skip
    else:
        if PROLOGUE == 1:
            y *= (1.0 / tl.sqrt(sq / K + eps))[:, None]
        _gemv_store(y, offs_m, offs_n, m_ok, n_ok, bias_ptr, res_ptr, out_ptr, s_rm, s_om,
                    HAS_BIAS, HAS_RES)  # fmt: skip


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    norm_of: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    prefetch: bool | None = None,
    stream: int | None = None,
    dot: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``prologue(x) @ weight.T (+ bias) (+ residual)`` for at most ``MAX_ROWS`` rows of ``x``.
    ``norm_weight``: the prologue is RMSNorm; ``silu_mul``: SiLU-and-multiply of ``x``
    ``[M, 2K]``, with ``norm_of`` ``[M, H]`` after scaling gate and up by each row's 1/rms of
    ``norm_of`` (``eps`` inside the root), as ``fused_ops.silu_and_mul(norm_of=)`` does (the
    norm before a gate/up projection it was folded into). ``out`` may be ``residual`` (updated
    in place). ``config``: (columns per program, K per iteration, warps, stages), default
    ``choose_launch(N, K)``'s. Launched with
    programmatic dependent launch where the device has it (``common.pdl_launch``); ``prefetch``
    (default: ``PREFETCH`` where PDL is on) reads the first weight slice before waiting for
    the previous kernel (a peeled first iteration). ``stream``: programs per SM of the
    fixed-grid kernel (``_gemv_stream_kernel``; 0: one program per column block,
    ``_gemv_kernel``); default ``choose_launch``'s without ``config``, else ``STREAM``.
    ``dot``: run on the tensor cores (``_gemv_dot_kernel``) with this (columns per program, K
    per iteration, warps, stages, programs a column block); default ``dot_launch(weight)``
    when neither ``config`` nor ``stream`` is given."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be 2-D")
    if norm_weight is not None and silu_mul:
        raise ValueError("gemv: one prologue at most (norm_weight or silu_mul)")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if norm_of is not None:
        if not silu_mul:
            raise ValueError("gemv: norm_of scales SiLU-and-multiply's input (silu_mul)")
        if norm_of.dim() != 2 or norm_of.shape[0] != m or norm_of.stride(1) != 1:
            raise ValueError(f"gemv: norm_of must be [{m}, hidden], its rows dense")
        if norm_of.dtype != x.dtype:
            raise ValueError(f"gemv: norm_of must be {x.dtype}, not {norm_of.dtype}")
        if out is not None and out.data_ptr() == norm_of.data_ptr():
            raise ValueError("gemv: out may not be norm_of (every program reads all of it)")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv: {m} rows; 1 to {MAX_ROWS} are supported")
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"gemv: x has {x.shape[1]} columns for a weight of K={k}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"gemv: x {x.dtype} and weight {weight.dtype} must be one float dtype")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv: the rows of x and weight must be contiguous")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    for t, what in ((out, "out"), (residual, "residual")):
        if t is not None and (tuple(t.shape) != (m, n) or t.stride(1) != 1 or t.dtype != x.dtype):
            raise ValueError(f"gemv: {what} must be a [{m}, {n}] {x.dtype} tensor, rows contiguous")
    if dot is None and config is None and stream is None:
        dot = dot_launch(weight)
    if dot is not None:
        _gemv_dot(x, weight, bias, norm_weight, eps, silu_mul, norm_of, residual, out, dot)
        return out
    if config is None:
        config, per_sm = choose_launch(n, k)
    else:
        per_sm = STREAM
    if stream is not None:
        per_sm = stream
    block_n, block_k, num_warps, num_stages = config
    block_k = min(block_k, max(16, next_pow2(k)))
    args, consts = _launch_args(x, weight, bias, norm_weight, eps, silu_mul, norm_of, residual,
                                out)  # fmt: skip
    consts.update(BLOCK_M=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                  num_stages=num_stages)  # fmt: skip
    if per_sm:
        grid = min(cdiv(n, block_n), per_sm * num_sms(x.device))
        launcher(_gemv_stream_kernel)((grid,), *args, **consts)
    else:
        prefetch = PREFETCH and bool(consts["PDL"]) if prefetch is None else prefetch
        launcher(_gemv_kernel)((cdiv(n, block_n),), *args, PREFETCH=prefetch, **consts)
    return out


def _launch_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    silu_mul: bool,
    norm_of: torch.Tensor | None,
    residual: torch.Tensor | None,
    out: torch.Tensor,
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The arguments every GEMV kernel takes first, and its prologue / epilogue constants and
    PDL launch options."""
    if norm_of is not None:
        prologue = PRO_SILU_MUL_NORMED
        nrm: tuple[torch.Tensor | int, ...] = (norm_of, norm_of.stride(0), norm_of.shape[1])
    else:
        prologue = (
            PRO_RMS_NORM if norm_weight is not None else PRO_SILU_MUL if silu_mul else PRO_NONE
        )
        nrm = (x, 0, 1)  # unused
    args = (
        x, weight, bias if bias is not None else x,
        norm_weight if norm_weight is not None else x,
        residual if residual is not None else out, out, x.shape[0], *weight.shape,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), eps, *nrm,
    )  # fmt: skip
    consts: dict[str, object] = dict(
        PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        **pdl_launch(x.device),
    )  # fmt: skip
    return args, consts


def _gemv_dot(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    silu_mul: bool,
    norm_of: torch.Tensor | None,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    launch: tuple[int, int, int, int, int],
) -> None:
    """Launch ``_gemv_dot_kernel`` (``gemv``'s arguments checked)."""
    block_n, block_k, num_warps, num_stages, split_k = launch
    m, (n, k) = x.shape[0], weight.shape
    block_k = min(block_k, max(16, next_pow2(k)))
    split_k = max(1, min(split_k, cdiv(k, block_k)))
    blocks = cdiv(n, block_n)
    if split_k > 1:
        part = torch.empty(split_k * m * (n + blocks), dtype=torch.float32, device=x.device)
        counters = zeroed_counters(x.device, blocks, "gemv")
    else:
        part = counters = out  # unused
    # bulk prefetches need 16-byte aligned rows
    aligned = weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0
    prefetch = DOT_PREFETCH * block_k if aligned and bulk_prefetch_ok(x.device) else 0
    # the folded norm's 1/rms before the loop, a row in one slice of up to 4,096
    rstd_k = min(4096, next_pow2(norm_of.shape[1])) if norm_of is not None else 16
    args, consts = _launch_args(x, weight, bias, norm_weight, eps, silu_mul, norm_of, residual,
                                out)  # fmt: skip
    launcher(_gemv_dot_kernel)(
        (blocks, split_k),
        *args, part, counters, **consts, BLOCK_M=max(16, next_pow2(m)), BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, RSTD_ROWS=next_pow2(m), RSTD_K=rstd_k,
        DOT_PREC=dot_precision(x.dtype), UPCAST=upcast_in_kernel(x), PREFETCH=prefetch,
        PREFETCH_BYTES=prefetch * weight.element_size(),
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip


def ref_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    norm_of: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same in torch ops: the SiLU-and-multiply prologue rounded to ``x``'s dtype (with
    ``norm_of``, gate and up scaled and rounded first), the normed rows not; the product
    accumulated in float32, one rounding at the end."""
    xf = x.float()
    if norm_weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight.float()
    elif silu_mul:
        if norm_of is not None:
            rstd = torch.rsqrt(norm_of.float().pow(2).mean(dim=-1, keepdim=True) + eps)
            xf = (xf * rstd).to(x.dtype).float()
        gate, up = xf.chunk(2, dim=-1)
        xf = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
    y = xf @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)
