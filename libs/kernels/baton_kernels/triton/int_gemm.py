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
- ``int_gemv``: the same product for a decode step's few rows without the tensor cores (which
  pad them to 16 and need the weight's tile rearranged through shared memory: in the GEMM's
  compiled loop ~16 instructions a weight, in the GEMV's ~5.5, counted in the sm_90 SASS):
  each value a shift, a mask, a conversion and a fused multiply-add a row of ``x``, or a byte
  permute and a subtraction in place of the first three (``GEMV_ASM``, inline PTX); K cut into
  pieces where the weight's rows give too few programs, their sums added by one more kernel.
- ``int_mm``: the GEMM for more rows (``int_linear.MM_ROWS``: none until measured): a dot a K
  tile of whole spans (128 or 256 columns) of ``u - z``, integers exact in 16-bit floats, its
  float32 sums then scaled, K cut into pieces where the tiles give too few programs.
- ``dequantize``: the whole weight in a float dtype (for products of many rows, which then run
  as one cuBLAS GEMM)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels.int_linear import SPAN_WORDS, span_cols
from baton_kernels.triton.common import (
    cdiv,
    dot_precision,
    next_pow2,
    num_sms,
    upcast_in_kernel,
)
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
# int_gemv (the few rows of a decode step, no tensor cores): (rows of the weight a program,
# pieces of K (0: enough programs for GEMV_WAVES a multiprocessor), warps, stages). GEMV: the
# fastest of 76 launches at one row over Llama-3.1-8B's and Qwen2.5-0.5B's projections on an
# H200 (a Llama layer 85.6 us against 122.4 in bf16 cuBLAS and 228.9 in int_gemm;
# benchmarks/RESULTS.md). Up to GEMV_MAX_ROWS rows (each one's sums held in registers; at 8
# rows they spill: 5x int_gemm's time).
GEMV: tuple[int, int, int, int] = (64, 0, 4, 3)
GEMV_WAVES = 4
GEMV_MAX_ROWS = 8
# the planes unpacked by byte permutes in inline PTX (_byte_planes) instead of a shift, a mask
# and a conversion a value: 6% faster at one row over the eight projections (H200)
GEMV_ASM = True
# int_mm (a dot a K tile of whole spans, the scale after the dot): (most rows of x a program,
# rows of the weight a program, K a tile, warps, stages) by the most rows it serves; 64: the
# fastest of the sweep over Llama's four projections at 32 rows (H100: 222 us a layer,
# transposed) and at 64 (279 us; 284 transposed), the others guesses; MM_SWAP: the transposed
# product (Llama's layer at 32 rows 224 us against 342, H100); K cut into pieces for at least
# MM_WAVES programs a multiprocessor
MM: dict[int, tuple[int, int, int, int, int]] = {
    16: (16, 64, 256, 4, 3),
    64: (128, 64, 128, 4, 1),
    1 << 30: (128, 128, 128, 8, 2),  # (3 stages need 256 KiB of shared memory: an H100 has 227)
}
MM_SWAP = True
MM_PERM = 0
MM_WAVES = 2


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


def _operands(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
) -> torch.Tensor:
    """``x`` with unit stride along K, once the packed weight's parts are checked to agree."""
    n, words = packed.shape
    assert words % SPAN_WORDS == 0 and words * (32 // bits) >= x.shape[1]
    assert scale.shape == zero.shape and scale.shape[0] == n
    assert packed.is_contiguous() and scale.is_contiguous() and zero.is_contiguous()
    return x if x.stride(1) == 1 else x.contiguous()


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
    x = _operands(x, packed, scale, zero, bits)
    (rows, k), (n, words) = x.shape, packed.shape
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
def _int_mm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, KW] int32, by spans
    s_ptr,  # [N, groups] float32
    z_ptr,  # [N, groups] uint8
    bias_ptr,  # [N]
    out_ptr,  # [M, N], or [split, M, N] float32 partial sums
    M,
    N,
    K,
    KW,  # words a row (a multiple of 16)
    GROUPS,
    s_xm,
    TILES_EACH,  # K tiles a program
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    SCALE: tl.constexpr,  # 0: a column's own, 1: one a tile, 2: one a row
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    SWAP: tl.constexpr,
    PERM: tl.constexpr,  # 0: a word loaded a column; 1, 2: once (see below)
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``int_mm``: a program ``BLOCK_M`` rows of ``x``, ``BLOCK_N`` rows of the weight (clamped
    to the last, so that no load of the weight is masked by rows) and ``TILES_EACH`` tiles of
    ``BLOCK_K`` columns (whole spans). Each column's word is loaded where the column lies in
    the tile (a word once a plane, from L1 after the first), so that the tile's values ``u``
    come out of one shift and mask already in the dot's order; ``u - z`` (integers, exact in
    16-bit floats) meets ``x`` in one dot a tile and the scale multiplies the dot's float32
    sums: once a tile where the tile lies in one group, once a row at the end where a row has
    one scale, else each value is scaled before the dot. ``PERM`` 1 and 2 load each word of
    the tile once instead and unpack all its planes; the dot's K is then the order (word,
    plane), into which ``x``'s columns are rearranged (1), or the planes are rearranged into
    the columns' order (2)."""
    SC: tl.constexpr = 16 * 32 // BITS  # (a span's columns)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    m_ok = offs_m < M
    PER: tl.constexpr = 32 // BITS
    if PERM:  # the tile's own words, their planes rearranged (2) or x's columns (1)
        w_tile = w_ptr + rows[:, None] * KW + tl.arange(0, BLOCK_K // PER)[None, :]
        shift = tl.arange(0, PER) * BITS
        # (PERM 1: K in the order (word, plane))
        col = (
            (offs_k // SC) * SC + (offs_k % PER) * 16 + (offs_k % SC) // PER
            if PERM == 1
            else offs_k
        )
    else:
        word = (offs_k // SC) * 16 + offs_k % 16  # (a column's word and bits within the tile)
        w_tile = w_ptr + rows[:, None] * KW + word[None, :]
        shift = (offs_k % SC) // 16 * BITS
        col = offs_k
    x_tile = x_ptr + offs_m[:, None].to(tl.int64) * s_xm + offs_k[None, :]
    sz = rows * GROUPS
    dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty  # (the interpreter's 16-bit dots)
    if SWAP:  # (the weight's rows the dots' M: Hopper's warpgroup MMA takes 64 of them)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    t0 = tl.program_id(1) * TILES_EACH
    t1 = tl.minimum(t0 + TILES_EACH, tl.cdiv(K, BLOCK_K))
    for t in range(t0, t1):
        k0 = t * BLOCK_K
        if EVEN_K:
            x = tl.load(x_tile + k0, mask=m_ok[:, None], other=0.0)
            words = tl.load(w_tile + t * (BLOCK_K // PER))
        elif PERM:
            x = tl.load(x_tile + k0, mask=m_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
            wd = t * (BLOCK_K // PER) + tl.arange(0, BLOCK_K // PER)
            words = tl.load(w_tile + t * (BLOCK_K // PER), mask=(wd < KW)[None, :], other=0)
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_tile + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            words = tl.load(w_tile + t * (BLOCK_K // PER), mask=k_ok[None, :], other=0)
        if PERM == 1:
            u = (words[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1)
            u = tl.reshape(u, [BLOCK_N, BLOCK_K])
            x = tl.reshape(x, [BLOCK_M, BLOCK_K // SC, PER, 16])
            x = tl.reshape(tl.permute(x, (0, 1, 3, 2)), [BLOCK_M, BLOCK_K])
        elif PERM == 2:
            u = (words[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1)
            u = tl.reshape(u, [BLOCK_N, BLOCK_K // SC, 16, PER])
            u = tl.reshape(tl.permute(u, (0, 1, 3, 2)), [BLOCK_N, BLOCK_K])
        else:
            u = (words >> shift[None, :]) & ((1 << BITS) - 1)
        if SCALE == 0:
            gk = tl.minimum((k0 + col) // GROUP, GROUPS - 1)
            z = tl.load(z_ptr + sz[:, None] + gk[None, :]).to(tl.int32)
            s = tl.load(s_ptr + sz[:, None] + gk[None, :])
            w = ((u - z).to(tl.float32) * s).to(dtype)
        else:
            g = tl.minimum(k0 // GROUP, GROUPS - 1)
            z = tl.load(z_ptr + sz + g).to(tl.int32)
            w = (u - z[:, None]).to(dtype)
        if SCALE == 1:
            s = tl.load(s_ptr + sz + tl.minimum(k0 // GROUP, GROUPS - 1))
            if SWAP:
                acc += tl.dot(w, tl.trans(x.to(dtype)), input_precision=PRECISION) * s[:, None]
            else:
                acc += tl.dot(x.to(dtype), tl.trans(w), input_precision=PRECISION) * s[None, :]
        elif SWAP:
            acc = tl.dot(w, tl.trans(x.to(dtype)), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x.to(dtype), tl.trans(w), acc, input_precision=PRECISION)
    if SWAP:  # noqa: SIM108  (a branch taken at compile time: the shapes differ)
        y = tl.trans(acc)
    else:
        y = acc
    if SCALE == 2:
        y *= tl.load(s_ptr + sz)[None, :]
    ok = m_ok[:, None] & (offs_n < N)[None, :]
    at = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if PARTIAL:
        tl.store(out_ptr + tl.program_id(1) * M * N + at, y, mask=ok)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
        tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=ok)


def _split_sum(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = part.sum(0) + bias`` (``part``: ``[split, M, N]`` float32) by one kernel."""
    split, rows, n = part.shape
    block = 1024
    launcher(_split_sum_kernel)(
        (triton.cdiv(rows * n, block),), part, bias, out, split, rows * n, n,
        HAS_BIAS=bias is not None, BLOCK=block,
    )  # fmt: skip


def mm_split(programs: int, tiles: int, device: torch.device) -> int:
    """The pieces K's ``tiles`` are cut into so that ``programs`` (of the whole K) become at
    least ``MM_WAVES`` a multiprocessor (none on a CPU)."""
    if device.type != "cuda":
        return 1
    return max(1, min(tiles, cdiv(MM_WAVES * num_sms(device), programs)))


def mm_config(rows: int) -> tuple[int, int, int, int, int]:
    """``MM``'s launch for a product of ``rows`` rows."""
    return MM[min(r for r in MM if r >= rows)]


def int_mm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
    swap: bool | None = None,
    split: int = 0,
    perm: int | None = None,
) -> torch.Tensor:
    """``int_gemm``'s product by one dot a K tile of whole spans (see ``_int_mm_kernel``):
    ``config`` (rows of ``x`` a program (at most), rows of the weight a program, K a tile,
    warps, stages), else ``MM`` for the rows; ``swap``: the transposed product (``MM_SWAP``);
    ``split``: pieces of K (0: by ``mm_split``), each writing float32 partial sums that one
    more kernel adds (with the bias)."""
    x = _operands(x, packed, scale, zero, bits)
    (rows, k), (n, words) = x.shape, packed.shape
    max_m, block_n, block_k, num_warps, num_stages = config or mm_config(rows)
    if upcast_in_kernel(x) and config is None:  # (the interpreter: each program costs time)
        block_n = 128
    sc = span_cols(bits)
    block_k = max(sc, block_k // sc * sc)
    groups = scale.shape[1]
    if groups == 1:
        how = 2
    else:
        while block_k > sc and group_size % block_k:
            block_k //= 2
        how = 1 if group_size % block_k == 0 else 0
    block_m = min(max(16, next_pow2(rows)), max_m)
    tiles = triton.cdiv(k, block_k)
    grid_nm = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m)
    split = min(split or mm_split(grid_nm, tiles, x.device), tiles)
    each = triton.cdiv(tiles, split)
    split = triton.cdiv(tiles, each)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32,
                                              device=x.device)  # fmt: skip
    launcher(_int_mm_kernel)(
        (triton.cdiv(n, block_n), split, triton.cdiv(rows, block_m)), x, packed, scale, zero,
        bias, part, rows, n, k, words, groups, x.stride(0), each, GROUP=group_size, BITS=bits,
        SCALE=how, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, PARTIAL=split > 1,
        SWAP=MM_SWAP if swap is None else swap, PERM=MM_PERM if perm is None else perm,
        PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_in_kernel(x), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split > 1:
        _split_sum(part, bias, out)
    return out


def _byte_planes_asm(bits: int) -> str:
    """PTX for ``_byte_planes``: each output a byte of the word(s) made the float ``2^23 + u`` by
    one byte permute (bits 0-7 the byte, 0x4B above), less ``2^23``."""
    lines = ["{", ".reg .b32 lo, hi;"]
    if bits == 4:  # (the even planes in lo's bytes, the odd ones in hi's)
        lines += ["and.b32 lo, $8, 0x0F0F0F0F;", "shr.u32 hi, $8, 4;"]
        lines += ["and.b32 hi, hi, 0x0F0F0F0F;"]
        sources = [("lo" if j % 2 == 0 else "hi", j // 2) for j in range(8)]
    else:
        sources = [("$4", j) for j in range(4)]
    for j, (src, byte) in enumerate(sources):
        lines.append(f"prmt.b32 ${j}, {src}, 0x4B000000, {0x7540 | byte:#x};")
        lines.append(f"sub.f32 ${j}, ${j}, 0f4B000000;")
    return "\n".join([*lines, "}"])


ASM_4 = tl.constexpr(_byte_planes_asm(4))
ASM_8 = tl.constexpr(_byte_planes_asm(8))


@triton.jit
def _byte_planes(words, BITS: tl.constexpr):
    """The ``32 / BITS`` planes of ``words`` as float32 values, by byte permutes (no shifts,
    masks or conversions a value; compiled GPUs only)."""
    if BITS == 4:
        return tl.inline_asm_elementwise(
            ASM_4, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return tl.inline_asm_elementwise(
            ASM_8, "=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 4, is_pure=True, pack=1
        )


@triton.jit
def _int_gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, KW] int32, by spans
    s_ptr,  # [N, groups] float32
    z_ptr,  # [N, groups] uint8
    bias_ptr,  # [N]
    out_ptr,  # [M, N], or [split, M, N] float32 partial sums
    M,
    N,
    K,
    KW,  # words a row (a multiple of 16)
    GROUPS,
    s_xm,
    SPANS_EACH,  # spans a program (of the K dimension)
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPAN_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``int_gemv``: a program ``BLOCK_N`` rows of the weight (clamped to the last, so that no
    load is masked) and ``SPANS_EACH`` spans of K, one span at a time: each plane's 16 values
    ``u`` become float32 (by a shift, a mask and a conversion, or by ``_byte_planes``) and meet
    the rows of ``x`` in fused multiply-adds, no tensor cores. Where a span lies in one group
    (``SPAN_SCALE``) the scale and zero point come once a span: ``s * (sum(u * x) - z *
    sum(x))``; else once a plane: ``(u * s - z * s) * x``."""
    PER: tl.constexpr = 32 // BITS
    SC: tl.constexpr = PER * 16  # (a span's columns)
    # every tensor three-dimensional (rows of x, rows of the weight, a span's words), the
    # words' loads in the layout of the arithmetic (no conversion through shared memory)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)[None, :, None]
    offs_m = tl.arange(0, BLOCK_M)[:, None, None]
    offs_w = tl.arange(0, 16)[None, None, :]
    m_ok = offs_m < M
    w_rows = w_ptr + rows * KW + offs_w
    sz_rows = rows * GROUPS
    x_rows = x_ptr + offs_m.to(tl.int64) * s_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N, 16], tl.float32)
    t0 = tl.program_id(1) * SPANS_EACH
    t1 = tl.minimum(t0 + SPANS_EACH, KW // 16)
    for t in range(t0, t1):
        words = tl.load(w_rows + t * 16)
        if SPAN_SCALE:
            g = tl.minimum(t * SC // GROUP, GROUPS - 1)
            s = tl.load(s_ptr + sz_rows + g)
            z = tl.load(z_ptr + sz_rows + g).to(tl.float32)
            part = tl.zeros([BLOCK_M, BLOCK_N, 16], tl.float32)
            xs = tl.zeros([BLOCK_M, 1, 16], tl.float32)
        if ASM:
            planes = _byte_planes(words, BITS)
        for j in tl.static_range(PER):
            kk = t * SC + j * 16 + offs_w
            if EVEN_K:
                x = tl.load(x_rows + kk, mask=m_ok, other=0.0)
            else:
                x = tl.load(x_rows + kk, mask=m_ok & (kk < K), other=0.0)
            x = x.to(tl.float32)
            if ASM:  # noqa: SIM108  (planes exists only then)
                u = planes[j]
            else:
                u = ((words >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
            if SPAN_SCALE:
                part += u * x
                xs += x
            else:
                gj = tl.minimum((t * SC + j * 16) // GROUP, GROUPS - 1)
                sj = tl.load(s_ptr + sz_rows + gj)
                zs = tl.load(z_ptr + sz_rows + gj).to(tl.float32) * sj
                acc += (u * sj - zs) * x
        if SPAN_SCALE:
            acc += s * (part - z * xs)
    y = tl.sum(acc, axis=2)
    offs_m = tl.arange(0, BLOCK_M)[:, None]
    ok = (offs_m < M) & (offs_n < N)[None, :]
    at = offs_m * N + offs_n[None, :]
    if PARTIAL:
        tl.store(out_ptr + tl.program_id(1) * M * N + at, y, mask=ok)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + tl.minimum(offs_n, N - 1)).to(tl.float32)[None, :]
        tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _split_sum_kernel(part_ptr, bias_ptr, out_ptr, SPLIT, MN, N, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    """``out = sum(part[:split]) (+ bias)`` in ``out``'s dtype (``part``: ``[split, M, N]``)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    y = tl.zeros([BLOCK], tl.float32)
    for i in range(SPLIT):
        y += tl.load(part_ptr + i * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def gemv_split(n: int, spans: int, block_n: int, device: torch.device) -> int:
    """The pieces K is cut into so that ``int_gemv`` launches at least ``GEMV_WAVES`` programs
    a multiprocessor (none where the rows alone give that many)."""
    if device.type != "cuda":
        return 1
    programs = cdiv(n, block_n)
    want = GEMV_WAVES * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(spans, cdiv(want, programs)))


def int_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    asm: bool | None = None,
) -> torch.Tensor:
    """``int_gemm``'s product for a few rows (up to ``GEMV_MAX_ROWS``) without the tensor cores:
    ``config`` (rows of the weight a program, pieces of K (0: by ``gemv_split``), warps,
    stages), else ``GEMV``; ``asm``: ``GEMV_ASM``'s choice for this call (not under the
    interpreter). With K in more than one piece each writes float32 partial sums and
    one more kernel adds them (and the bias)."""
    x = _operands(x, packed, scale, zero, bits)
    (rows, k), (n, words) = x.shape, packed.shape
    assert rows <= GEMV_MAX_ROWS
    block_n, split, num_warps, num_stages = config or GEMV
    spans = words // SPAN_WORDS
    split = min(split or gemv_split(n, spans, block_n, x.device), spans)
    each = triton.cdiv(spans, split)
    split = triton.cdiv(spans, each)
    groups = scale.shape[1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32,
                                              device=x.device)  # fmt: skip
    launcher(_int_gemv_kernel)(
        (triton.cdiv(n, block_n), split), x, packed, scale, zero, bias, part, rows, n, k, words,
        groups, x.stride(0), each, GROUP=group_size, BITS=bits,
        HAS_BIAS=bias is not None, SPAN_SCALE=group_size % span_cols(bits) == 0 or groups == 1,
        EVEN_K=k % span_cols(bits) == 0, PARTIAL=split > 1,
        ASM=(GEMV_ASM if asm is None else asm) and not upcast_in_kernel(x), BLOCK_M=next_pow2(rows),
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split > 1:
        _split_sum(part, bias, out)
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
