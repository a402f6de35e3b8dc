# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""The MLP's down projection with SiLU-and-multiply in front and the residual add behind, in one
launch: ``out = residual + silu(gate) * up @ weight.T`` for the fused gate/up output
``x = [gate | up]``.

A decode step of a small model at a few hundred requests runs its down projection as three
launches (SiLU-and-multiply, cuBLAS's split-K GEMM, its reduce) of a few microseconds each: with
N = 896 output columns the GEMM has too few tiles for the 132 SMs unless it splits K, and each
launch costs more than its bytes. Here each program computes one ``BLOCK_M x BLOCK_N`` tile over
one of ``split_k`` slices of K, forming its A tile from ``gate`` and ``up`` as it loads them
(``silu_and_mul``'s math and rounding). With ``split_k > 1`` each program stores its float32
partial; the last program of a tile (an atomic count, as ``decode_attention``'s fused reduce)
adds the partials in slice order, so the result does not depend on which program finished last,
adds the residual row and stores the tile.

``norm_of`` is ``silu_and_mul``'s: gate and up come from a projection whose weight holds an
RMSNorm's (``fold_norms``) and are first scaled by the 1/rms of each row of ``norm_of``. The
output is a new tensor, never ``norm_of`` or ``residual`` in place: other programs may still be
reading those rows.

Measured slower than what it replaces, so the engine does not use it (``model_runner``'s
``FUSED_DOWN_*`` are off): on an H200 at Qwen2.5-0.5B's shape (4,864 -> 896, bf16) the best of
~50 tile shapes and K splits took 47.6 us at 256 rows against 13.9 for SiLU-and-multiply,
cuBLAS's split-K GEMM and its reduce; 18.9 against 10.5 at 64 rows; 659 against 307 us for a
16,384-token prompt step (``benchmarks/bench_silu_linear_gpu.py``, RESULTS.md, twenty-fifth
session). Compiled for sm_90 the loop has the expected shape (gate, up and the weight tile
copied asynchronously in 3 stages, wgmma with A from registers); why it is slow is open
(``benchmarks/device/silu_linear_probe.py`` times it with its parts turned off).
"""

from __future__ import annotations

from typing import NamedTuple

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
    zeroed_counters,
)

NORM_CHUNK = 256  # columns of a ``norm_of`` row summed per step
MIN_SPLIT_K = 256  # no K slice shorter than this


class SiluLinearConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


# Tiles measured best on an H200 per weight shape (N, K): (most rows, config), rows ascending
# (benchmarks/bench_silu_linear_gpu.py). Other shapes, and more rows, take default_config's.
TUNED: dict[tuple[int, int], list[tuple[int, SiluLinearConfig]]] = {}


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> SiluLinearConfig:
    """Tiles for ``m`` rows, ``n`` output columns and ``k`` inputs: ``TUNED``'s, else K split
    until the tiles cover the SMs (slices of at least ``MIN_SPLIT_K``)."""
    for max_m, tuned in TUNED.get((n, k), ()):
        if m <= max_m:
            return tuned
    block_m = min(64, max(16, next_pow2(m)))
    block_n, block_k = 128, 64
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    split = 1
    while tiles * split * 2 <= num_sms and k // (split * 2) >= MIN_SPLIT_K:
        split *= 2
    return SiluLinearConfig(block_m, block_n, block_k, split)


@triton.jit
def _silu_linear_kernel(
    x_ptr,  # [M, 2K]: gate = x[:, :K], up = x[:, K:]; rows dense, as w's, out's and res's
    w_ptr,  # [N, K]
    out_ptr,  # [M, N]
    res_ptr,  # [M, N] (RESIDUAL)
    part_ptr,  # [SPLIT_K, M, N] float32 (SPLIT_K > 1)
    counter_ptr,  # one int32 per tile, zero between launches (SPLIT_K > 1)
    M,
    N,
    K,
    s_xm,
    s_wn,
    s_om,
    s_rm,
    norm_ptr,  # NORM: [M, hidden], rows dense
    s_nm,
    hidden,
    eps,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: programs that run together share rows of x and columns of w in the L2
    group = GROUP_M * grid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = offs_m.to(tl.int64)
    dtype = x_ptr.dtype.element_ty

    if NORM:  # 1/rms of each row of norm_of
        sq = tl.zeros([BLOCK_M], tl.float32)
        for h in range(0, hidden, NORM_BLOCK):
            offs_h = h + tl.arange(0, NORM_BLOCK)
            xs = tl.load(
                norm_ptr + rows[:, None] * s_nm + offs_h[None, :],
                mask=m_ok[:, None] & (offs_h < hidden)[None, :],
                other=0.0,
            ).to(tl.float32)
            sq += tl.sum(xs * xs, axis=1)
        rstd = tl.rsqrt(sq / hidden + eps)

    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_len
    k_end = tl.minimum(k_start + k_len, K)
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs = x_ptr + rows[:, None] * s_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * s_wn + (k_start + offs_k)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a_mask = m_ok[:, None]
            w_mask = n_ok[None, :]
        else:
            k_ok = offs_k < k_end - k
            a_mask = m_ok[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & n_ok[None, :]
        gate = tl.load(gate_ptrs, mask=a_mask, other=0.0)
        up = tl.load(gate_ptrs + K, mask=a_mask, other=0.0)
        if NORM:  # rounded as the unfolded projection's output is
            gate = (gate.to(tl.float32) * rstd[:, None]).to(dtype)
            up = (up.to(tl.float32) * rstd[:, None]).to(dtype)
        g = gate.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(dtype)  # silu_and_mul's output
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        gate_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        part = part_ptr + (pid_k * M + rows)[:, None] * N + offs_n[None, :]
        tl.store(part, acc, mask=mask)
        # every thread's partial is stored before the release of the count; the last
        # program's acquire makes all of them visible to it (read past L1: ".cg")
        tl.debug_barrier()
        counter = counter_ptr + pid
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") != SPLIT_K - 1:
            return
        tl.debug_barrier()
        tl.store(counter, 0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(SPLIT_K):  # in slice order: the same sum whoever is last
            acc += tl.load(
                part_ptr + (s * M + rows)[:, None] * N + offs_n[None, :],
                mask=mask,
                other=0.0,
                cache_modifier=".cg",
            )
    if RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * s_rm + offs_n[None, :], mask=mask, other=0.0)
        acc += res.to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * s_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    norm_of: torch.Tensor | None = None,
    eps: float = 0.0,
    out: torch.Tensor | None = None,
    config: SiluLinearConfig | None = None,
) -> torch.Tensor:
    """``[residual +] silu_and_mul(x, norm_of=norm_of, eps=eps) @ weight.T`` in one launch, for
    ``x`` ``[M, 2 * K]`` and ``weight`` ``[N, K]``; ``residual`` ``[M, N]``: each with its rows
    dense (any row stride). The float32 sum is rounded once to ``x.dtype``. Returns ``out``
    (``[M, N]``, rows dense, which must not be ``x``, ``residual`` or ``norm_of``) or a new
    tensor."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [tokens, 2 * intermediate]: {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    m, k = x.shape[0], x.shape[1] // 2
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be [out_features, {k}] {x.dtype}: {tuple(weight.shape)} {weight.dtype}"
        )
    n = weight.shape[0]
    for name, t in (("weight", weight), ("residual", residual), ("norm_of", norm_of)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    for name, t in (("x", x), ("weight", weight), ("residual", residual), ("out", out)):
        if t is not None and t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have its rows dense (stride 1 along them)")
    if residual is not None and (tuple(residual.shape) != (m, n) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be [{m}, {n}] {x.dtype}: {tuple(residual.shape)}")
    if norm_of is not None and (
        norm_of.dim() != 2 or norm_of.shape[0] != m or norm_of.stride(1) != 1
    ):
        raise ValueError(f"norm_of must be [{m}, hidden], its rows dense")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} on {x.device}: {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    if any(t is not None and t.data_ptr() == out.data_ptr() for t in (x, residual, norm_of)):
        raise ValueError("out must not be x, residual or norm_of")
    if k == 0:
        return out.copy_(residual) if residual is not None else out.zero_()
    cfg = config or default_config(m, n, k)
    split = max(1, min(cfg.split_k, cdiv(k, cfg.block_k)))
    num_tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = zeroed_counters(x.device, num_tiles, "silu_and_mul_linear")
    else:
        part = counters = out  # unused
    res = residual if residual is not None else out
    norm_args = (
        (norm_of, norm_of.stride(0), norm_of.shape[1], eps)
        if norm_of is not None
        else (x, 0, 1, 0.0)
    )
    _silu_linear_kernel[(num_tiles, split)](
        x, weight, out, res, part, counters, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), res.stride(0), *norm_args,
        NORM=norm_of is not None,
        RESIDUAL=residual is not None,
        SPLIT_K=split,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        NORM_BLOCK=min(NORM_CHUNK, next_pow2(norm_of.shape[1])) if norm_of is not None else 1,
        GROUP_M=8,
        UPCAST=upcast_in_kernel(x),
        DOT_PREC=dot_precision(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(x.device),
    )  # fmt: skip
    return out


def ref_silu_and_mul_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_of: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """The unfused path: SiLU-and-multiply rounded to the dtype, then one GEMM (adding into
    ``residual`` in float32, as ``addmm``)."""
    if norm_of is not None:
        rstd = torch.rsqrt(norm_of.float().pow(2).mean(-1, keepdim=True) + eps)
        x = (x.float() * rstd).to(x.dtype)
    gate, up = x.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    y = act.float() @ weight.float().t()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)
