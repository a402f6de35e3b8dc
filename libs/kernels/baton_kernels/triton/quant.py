# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""The FP8 linear layers' kernels (``fp8_linear``):

- ``quantize_rows``: dynamic per-token FP8 quantization of a layer's input: each row ``x[m]``
  becomes ``q[m] = x[m] / s[m]`` in float8_e4m3fn with ``s[m] = max|x[m]| / 448`` (at least
  ``MIN_SCALE``), saturated and rounded to nearest even, in one launch (torch ops take five:
  abs, amax, division, clamp, cast). The scale is ``max|x[m]|`` times the float32 of 1/448
  (torch's CUDA division by a number multiplies by its reciprocal), ``1 / s[m]`` a division
  rounded to nearest (``div_rn``: Triton's own is approximate, torch's is not).
- ``fp8_gemv``: the product of a few such rows with an FP8 weight, for decode steps of a few
  requests, where the FP8 GEMM's tiles of 64+ rows leave the weight reads far from the
  memory's bandwidth: the same products (each exact in float32) summed in another order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels.fp8_linear import FP8_DTYPE, FP8_MAX, MIN_SCALE
from baton_kernels.triton.common import cache_value, next_pow2
from baton_kernels.triton.launch import launcher

_MAX_BLOCK = 4096


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    cols,
    s_xm,
    s_qm,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    INV_FP8: tl.constexpr,
    MIN: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    src = x_ptr + row.to(tl.int64) * s_xm
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        mask = start + offs < cols
        x = tl.load(src + start + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) * INV_FP8, MIN)
    tl.store(scale_ptr + row, scale)
    inv = tl.math.div_rn(1.0, scale)
    dst = q_ptr + row.to(tl.int64) * s_qm
    for start in range(0, cols, BLOCK):
        mask = start + offs < cols
        x = tl.load(src + start + offs, mask=mask, other=0.0)
        tl.store(dst + start + offs, cache_value(x, q_ptr, inv, FP8), mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (unit stride along K) as FP8 rows and their float32 scales ``[M]``:
    ``fp8_linear.ref_quantize_rows``, bit for bit."""
    rows, cols = x.shape
    assert x.stride(1) == 1, "the rows must be contiguous"
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = min(next_pow2(cols), _MAX_BLOCK)
    launcher(_quantize_rows_kernel)(
        (rows,),
        x,
        q,
        scale,
        cols,
        x.stride(0),
        q.stride(0),
        BLOCK=block,
        FP8=FP8_MAX,
        INV_FP8=1.0 / FP8_MAX,
        MIN=MIN_SCALE,
        num_warps=4 if block <= 1024 else 8,
    )
    return q, scale


GEMV_MAX_ROWS = 4
# fp8_gemv's default launch on the tensor cores (columns per program, K per iteration, warps,
# stages); None: the CUDA-core kernel. The best of a sweep over Llama-3.1-8B's projections at 1
# row on an H100 (fp8gemv55.py, graph-timed: 88.9 us for the four against 98.2 on the CUDA
# cores, 154.1 for bf16 cuBLAS); batch-1 decode through the engine: Llama's shape 233.1 tok/s
# against 201.5 on the CUDA cores (178.3 in bf16), Qwen2.5-0.5B's 825.2 against 744.3
# (benchmarks/RESULTS.md)
GEMV_DOT: tuple[int, int, int, int] | None = (32, 1024, 4, 3)


@triton.jit
def _fp8_gemv_kernel(
    q_ptr,  # [M, K] FP8
    q_scale_ptr,  # [M] float32
    w_ptr,  # [N, K] FP8
    w_scale_ptr,  # [N] float32
    bias_ptr,  # [N]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    s_qm,
    s_wn,
    s_om,
    HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program a block of ``BLOCK_N`` output columns, over the whole of K. On the CUDA
    cores the products are summed lane by lane over the K loop and across the lanes once at
    the end; on the tensor cores (``DOT``) the rows are padded to ``BLOCK_M`` (16, the
    smallest tile) and each K slice is one FP8 dot, whose weight loads Triton's software
    pipeline keeps in flight (``num_stages``)."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    q_rows = q_ptr + offs_m[:, None] * s_qm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * s_wn
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(q_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            acc = tl.dot(q, tl.trans(w), acc)
        else:
            acc += q.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if DOT:  # noqa: SIM108  (a branch taken at compile time: the shapes differ)
        y = acc
    else:
        y = tl.sum(acc, axis=2)
    _fp8_gemv_store(y, q_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok,
                    s_om, HAS_BIAS)  # fmt: skip


@triton.jit
def _fp8_gemv_store(
    y, q_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, s_om,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The float32 sums ``y`` ``[BLOCK_M, BLOCK_N]`` times both scales, plus the bias, stored."""
    y *= tl.load(q_scale_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    y *= tl.load(w_scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * s_om + offs_n[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def fp8_gemv(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    dot: tuple[int, int, int, int] | str | None = "default",
) -> torch.Tensor:
    """``(q * q_scale) @ (weight * weight_scale).T (+ bias)`` for ``q`` ``[M, K]`` FP8 rows
    (``quantize_rows``), M at most ``GEMV_MAX_ROWS``, reading ``weight`` ``[N, K]`` once.
    ``dot``: on the tensor cores (``_fp8_gemv_kernel``'s ``DOT``) with this (columns per
    program, K per iteration, warps, stages); "default": ``GEMV_DOT``'s; None: the CUDA
    cores."""
    rows, k = q.shape
    n = weight.shape[0]
    assert 1 <= rows <= GEMV_MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1
    out = torch.empty(rows, n, dtype=out_dtype, device=q.device)
    launch = GEMV_DOT if dot == "default" else dot
    if isinstance(launch, tuple):
        block_m, (block_n, block_k, num_warps, num_stages) = 16, launch
        block_k = min(block_k, max(32, next_pow2(k)))
    else:  # (Triton's default stages on NVIDIA GPUs, as the CUDA-core launch was measured)
        block_m, block_n, num_warps, num_stages = next_pow2(rows), 16, 4, 3
        block_k = min(512 if block_m <= 2 else 256, max(16, next_pow2(k)))
    launcher(_fp8_gemv_kernel)(
        (triton.cdiv(n, block_n),), q, q_scale, weight, weight_scale, bias, out, rows, n, k,
        q.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        DOT=isinstance(launch, tuple), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
