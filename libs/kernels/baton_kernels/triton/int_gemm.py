# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""The integer-weight layers' kernels (``int_linear``), weights ``w = (u - z) * s`` packed
into int32 words by spans (``int_linear.pack_spans``: a span's 16 words hold ``32 / bits``
planes of 16 consecutive columns), a float32 scale and a zero point a row and group:

- ``int_gemm``: ``x @ w.T (+ bias)`` reading the packed weight: each program a tile of rows
  and ``BLOCK_N`` output columns over the whole of K, loading ``SPANS`` spans of words at a
  time; each plane (a shift and a mask of the words) becomes ``(u - z) * s`` in the
  activations' dtype (the reference's rounding) and one dot of K = 16 on the tensor cores.
  The integers become floats by conversion instructions or by their bits (``MAGIC``: ``u |
  0x4B000000`` read as a float32 is ``2^23 + u``; measured 2-5% slower). ``SWAP`` computes
  the transposed product instead (the weight's rows the dots' M dimension).
- ``dequantize``: the whole weight in a float dtype (for products of many rows, which then run
  as one cuBLAS GEMM)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels.int_linear import SPAN_WORDS, span_cols
from baton_kernels.triton.common import dot_precision, upcast_in_kernel
from baton_kernels.triton.launch import launcher

# (columns a program, K a step (a multiple of a span's columns, else one span), warps, stages)
# by the step's rows: a decode step's few rows are padded to 16 (the tensor cores' smallest
# tile). GEMM_SMALL: the fastest of 36 launches at one row over Llama-3.1-8B's four
# projections on an H100 (224 us a layer against 294 for (16, 128, 2, 3); bf16 cuBLAS 166:
# benchmarks/RESULTS.md). GEMM_LARGE was not swept (int_linear runs more than 16 rows through
# cuBLAS).
SMALL_M = 16
GEMM_SMALL: tuple[int, int, int, int] = (32, 128, 4, 3)
GEMM_LARGE: tuple[int, int, int, int] = (128, 128, 4, 3)
# integers to floats by their bits, else by conversion instructions (2-5% faster than by their
# bits on an H100: benchmarks/RESULTS.md)
MAGIC = False
# the dots as weight @ x.T (the weight's rows their M), transposed once at the end; not yet
# measured (bench_int_linear_gpu.py times it)
SWAP = False


@triton.jit
def _plane(words, z, s, j: tl.constexpr, BITS: tl.constexpr, MAGIC_FLOAT: tl.constexpr,
           DTYPE: tl.constexpr):  # fmt: skip
    """Plane ``j`` of ``words`` (``[BLOCK_N, 16]``) as ``(u - z) * s`` in ``DTYPE`` (``z``,
    ``s``: ``[BLOCK_N]``)."""
    u = (words >> (j * BITS)) & ((1 << BITS) - 1)
    if MAGIC_FLOAT:
        f = (u | 0x4B000000).to(tl.float32, bitcast=True)
        d = f - (z.to(tl.float32) + 8388608.0)[:, None]
    else:
        d = (u - z.to(tl.int32)[:, None]).to(tl.float32)
    return (d * s[:, None]).to(DTYPE)


@triton.jit
def _int_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, KW] int32, by spans
    s_ptr,  # [N, groups] float32
    z_ptr,  # [N, groups] uint8
    bias_ptr,  # [N]
    out_ptr,  # [M, N]
    M,
    N,
    K,
    KW,  # words a row (a multiple of 16)
    GROUPS,
    s_xm,
    s_om,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    MAGIC_FLOAT: tl.constexpr,
    SWAP: tl.constexpr,
    SPANS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, 16)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * s_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * KW
    sz_rows = offs_n.to(tl.int64) * GROUPS
    if SWAP:  # (the weight's rows the dots' M: Hopper's warpgroup MMA takes 64 of them)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for w0 in range(0, KW, 16 * SPANS):
        for span in tl.static_range(SPANS):
            ww = w0 + span * 16 + offs_w
            words = tl.load(w_rows + ww[None, :], mask=n_ok[:, None] & (ww < KW)[None, :],
                            other=0)  # fmt: skip
            for j in tl.static_range(PER):
                k0 = (w0 + span * 16) * PER + j * 16
                kk = k0 + offs_w
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :],
                            other=0.0)  # fmt: skip
                dtype = tl.float32 if UPCAST else x.dtype  # (the interpreter's 16-bit dots)
                g = tl.minimum(k0 // GROUP, GROUPS - 1)  # (a padded plane: any group)
                s = tl.load(s_ptr + sz_rows + g, mask=n_ok, other=0.0)
                z = tl.load(z_ptr + sz_rows + g, mask=n_ok, other=0)
                w = _plane(words, z, s, j, BITS, MAGIC_FLOAT, dtype)
                if SWAP:
                    acc = tl.dot(w, tl.trans(x.to(dtype)), acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(x.to(dtype), tl.trans(w), acc, input_precision=PRECISION)
    if SWAP:  # noqa: SIM108  (a branch taken at compile time: the shapes differ)
        y = tl.trans(acc)
    else:
        y = acc
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def int_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    magic: bool | None = None,
    swap: bool | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` (unit stride along K) times the span-packed weight ``[N, K]``,
    transposed, plus ``bias``: ``[M, N]`` in ``x``'s dtype. ``config``: (columns a program, K a
    step, warps, stages), else ``GEMM_SMALL`` or ``GEMM_LARGE`` by the rows; ``magic``,
    ``swap``: ``MAGIC``'s and ``SWAP``'s choices for this call."""
    rows, k = x.shape
    n, words = packed.shape
    assert words % SPAN_WORDS == 0 and words * (32 // bits) >= k
    assert scale.shape == zero.shape and scale.shape[0] == n
    assert packed.is_contiguous() and scale.is_contiguous() and zero.is_contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m = SMALL_M if rows <= SMALL_M else 64
    block_n, step, num_warps, num_stages = config or (GEMM_SMALL if rows <= SMALL_M else GEMM_LARGE)
    if config is None and upcast_in_kernel(x):  # (the interpreter: each program costs time)
        block_n, step = 128, 512
    launcher(_int_gemm_kernel)(
        (triton.cdiv(n, block_n), triton.cdiv(rows, block_m)), x, packed, scale, zero, bias,
        out, rows, n, k, words, scale.shape[1], x.stride(0), out.stride(0), GROUP=group_size,
        BITS=bits, HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_in_kernel(x), MAGIC_FLOAT=MAGIC if magic is None else magic,
        SWAP=SWAP if swap is None else swap,
        SPANS=max(1, step // span_cols(bits)), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


@triton.jit
def _dequantize_kernel(
    w_ptr,  # [N, KW] int32, by spans
    s_ptr,  # [N, groups] float32
    z_ptr,  # [N, groups] uint8
    out_ptr,  # [N, K]
    N,
    K,
    KW,
    GROUPS,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    MAGIC_FLOAT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program a span of ``BLOCK_N`` rows."""
    PER: tl.constexpr = 32 // BITS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w0 = tl.program_id(1) * 16
    offs_w = tl.arange(0, 16)
    n_ok = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    words = tl.load(w_ptr + rows * KW + (w0 + offs_w)[None, :], mask=n_ok[:, None], other=0)
    for j in tl.static_range(PER):
        k0 = w0 * PER + j * 16
        kk = k0 + offs_w
        g = tl.minimum(k0 // GROUP, GROUPS - 1)
        s = tl.load(s_ptr + offs_n.to(tl.int64) * GROUPS + g, mask=n_ok, other=0.0)
        z = tl.load(z_ptr + offs_n.to(tl.int64) * GROUPS + g, mask=n_ok, other=0)
        w = _plane(words, z, s, j, BITS, MAGIC_FLOAT, out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows * K + kk[None, :], w, mask=n_ok[:, None] & (kk < K)[None, :])


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The span-packed weight as ``[N, k]`` in ``dtype`` (``int_linear.ref_dequantize``,
    rounded)."""
    n, words = packed.shape
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    block_n = 64
    launcher(_dequantize_kernel)(
        (triton.cdiv(n, block_n), words // SPAN_WORDS), packed, scale, zero, out, n, k, words,
        scale.shape[1], GROUP=group_size, BITS=bits, MAGIC_FLOAT=MAGIC, BLOCK_N=block_n,
    )  # fmt: skip
    return out
