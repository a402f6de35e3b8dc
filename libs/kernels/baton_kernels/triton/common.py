# Triton kernels (untyped decorator, pointer and stride arguments) are exempt; launchers are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""Pieces shared by the Triton kernels: loading one K/V tile through the block table, a tile's
scores (softcapped or not), one step of the online softmax, and launch-time helpers."""

from __future__ import annotations

import math
import os
from functools import cache

import torch
import triton
import triton.language as tl

from baton_kernels.attention.base import FP8_KV_DTYPES, KVCacheView

LOG2E = math.log2(math.e)
_TWO_LOG2E: tl.constexpr = tl.constexpr(2 * LOG2E)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

# Programmatic dependent launch (Hopper and later): the Triton kernels of the decoder layers
# (``gemv``, the rotary + K/V write, ``decode_attention``, RMSNorm, SiLU-and-multiply) are
# launched so that each may start while the kernel before it drains, and wait
# (``griddepcontrol.wait``) before they read anything it wrote. ``BATON_PDL=0`` turns it off.
# (Triton 3.4 and later have the instructions and the launch option; its interpreter has neither.)
PDL = (
    os.environ.get("BATON_PDL", "1") != "0"
    and os.environ.get("TRITON_INTERPRET") != "1"
    and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")
)


_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}


def zeroed_counters(device: torch.device, n: int, owner: str) -> torch.Tensor:
    """At least ``n`` int32 counters on ``device`` for the kernels of ``owner`` whose last
    program (found by an atomic count) finishes a reduction: zeros, kept zero by those kernels
    (the last program resets its counter, so a CUDA graph replays as captured), grown (never
    during a capture: its warm-up runs have sized them). One set per (device, owner), so one
    owner's launches on a device must not run concurrently (an engine launches on one
    stream)."""
    counters = _COUNTERS.get((device, owner))
    if counters is None or counters.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: run the captured size once before capture")
        size = max(n, 4096 if counters is None else 2 * counters.numel())
        counters = torch.zeros(size, dtype=torch.int32, device=device)
        _COUNTERS[device, owner] = counters
    return counters


@cache
def _capability_major(device_index: int | None) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def num_sms(device: torch.device) -> int:
    """The device's multiprocessors (4 on a CPU, where the interpreter runs the kernels)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Launch arguments for a kernel with a ``PDL`` constexpr that waits for the previous grid
    before its first dependent read: ``PDL`` and ``launch_pdl`` on a CUDA device that supports
    it (with ``PDL`` on), else ``PDL=False`` alone (older GPUs launch as usual)."""
    if PDL and device.type == "cuda" and _capability_major(device.index) >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def bulk_prefetch_ok(device: torch.device) -> bool:
    """Whether kernels on ``device`` may issue Hopper's bulk L2 prefetches (compiled code on
    sm_90 or later; the interpreter runs no inline assembly)."""
    return (
        device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and _capability_major(device.index) >= 9
    )


@triton.jit
def prefetch_rows_l2(ptrs, ok, ROW_BYTES: tl.constexpr):
    """Start reading the ``ROW_BYTES`` at each of ``ptrs`` (where ``ok``) into the L2, without
    waiting (Hopper's bulk L2 prefetch: 16-byte aligned rows, a multiple of 16 bytes)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred has; setp.gt.s32 has, $2, 0; "
        "@has cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, tl.where(ok, ROW_BYTES, 0)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """A PDL kernel's start: let the next kernel launch once every program has begun (it waits
    for this grid's end before its own dependent reads), then wait for the previous grid."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def check_kv_cache(kv_cache: KVCacheView, query: torch.Tensor) -> None:
    kv = kv_cache.kv
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"expected a [num_blocks, 2, block_size, kv_heads, dim] view: {kv.shape}")
    if kv.dtype != query.dtype and kv.dtype not in FP8_KV_DTYPES:
        raise ValueError(f"cache dtype {kv.dtype} differs from query dtype {query.dtype}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {query.dtype}")
    if query.shape[-1] != kv.shape[-1] or query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head size {query.shape[-1]} (cache {kv.shape[-1]}) is not supported")
    if query.shape[1] % kv.shape[3]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {kv.shape[3]}")


def check_window_softcap(window: int, softcap: float) -> None:
    if window < 0 or softcap < 0:
        raise ValueError(f"window {window} and softcap {softcap} must be >= 0 (0: off)")


def upcast_in_kernel(t: torch.Tensor) -> bool:
    """Kernels given CPU tensors run under the interpreter, which cannot do 16-bit float math."""
    return t.device.type == "cpu"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs would default to TF32 on the tensor cores; keep them exact."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two, at least 16 (the tensor cores' smallest K)."""
    return max(16, next_pow2(head_dim))


@triton.jit
def load_kv_tile(
    kv_ptr,
    table_ptr,  # this request's row of the block table
    pos,  # [TILE_N] key positions
    pos_ok,  # [TILE_N] which of them exist (read only when MASK_POS)
    kv_head,
    offs_d,  # [BLOCK_D]
    s_cb,
    s_ckv,
    s_cs,
    s_ch,
    s_cd,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_POS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """K transposed ``[BLOCK_D, TILE_N]`` and V ``[TILE_N, BLOCK_D]`` at the given positions;
    masked-off positions and padded dims read as 0. In the cache's dtype (float32 with
    ``UPCAST``): the caller casts an 8-bit cache's to its query's."""
    if MASK_POS:
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + pos // BLOCK_SIZE).to(tl.int64)
    row = block * s_cb + (pos % BLOCK_SIZE) * s_cs + kv_head * s_ch  # [TILE_N]
    k_ptrs = kv_ptr + row[None, :] + offs_d[:, None] * s_cd
    v_ptrs = kv_ptr + s_ckv + row[:, None] + offs_d[None, :] * s_cd
    if MASK_POS:
        d_ok = offs_d < HEAD_DIM
        k = tl.load(k_ptrs, mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
    elif BLOCK_D != HEAD_DIM:
        d_ok = offs_d < HEAD_DIM
        k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def cache_value(x, kv_ptr, inv_scale, KV_MAX: tl.constexpr):
    """``x`` as the cache at ``kv_ptr`` stores it: in its dtype; for an 8-bit cache
    (``KV_MAX``: its largest finite value, ``attention.base.cache_max``; 0 for none) times
    ``inv_scale`` (1 / the layer's scale), saturated and rounded to nearest, ties to even,
    as ``attention.base.to_cache_dtype`` (torch's cast) does.

    The rounding is done here, in float32, so that the cast after it is exact: Triton's
    interpreter (the CPU tests) truncates where a cast should round up across a power of two
    (0.49 became 0.25 instead of 0.5). Adding and subtracting ``c`` = 1.5 * 2^(k + 23) rounds
    a magnitude below 2^(k + m) to a multiple of 2^k (the float32 add rounds to nearest
    even): k is the 8-bit float's step at the value's binade (m mantissa bits; below its
    smallest normal binade, the subnormals', a fixed step)."""
    if KV_MAX > 0:
        f = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -KV_MAX), KV_MAX)
        bits = f.to(tl.int32, bitcast=True)
        binade = ((bits >> 23) & 0xFF) - 127
        # (a branch taken at compile time: KV_MAX is a constexpr)
        if KV_MAX == 448.0:  # noqa: SIM108  e4m3fn: 3 mantissa bits, normal from 2^-6
            step = tl.maximum(binade, -6) - 3
        else:  # e5m2: 2 mantissa bits, normal from 2^-14
            step = tl.maximum(binade, -14) - 2
        c = (((step + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
        rounded = ((tl.abs(f) + c) - c).to(tl.int32, bitcast=True)
        # the sign put back as a bit (-0.0 stays -0.0: Triton's negation is 0 - x)
        x = (rounded | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return x.to(kv_ptr.dtype.element_ty)


@triton.jit
def online_softmax_step(
    s,  # [M, TILE_N] fp32 scores, already scaled by scale * log2(e) and masked with -inf
    v,  # [TILE_N, BLOCK_D]
    m_i,  # [M] running max (log2 domain)
    l_i,  # [M] running sum of exp2
    acc,  # [M, BLOCK_D] fp32 running numerator
    DOT_PREC: tl.constexpr,
):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen only masked keys keeps m = -inf; exp2(-inf - -inf) would be NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def tile_scores(
    q,  # [M, BLOCK_D]
    k,  # [BLOCK_D, TILE_N]
    qk_scale,  # softmax scale * log2(e)
    cap,  # SOFTCAP: the softcap * log2(e)
    SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """``[M, TILE_N]`` fp32 scores in the log2 domain the online softmax takes: ``scale * q.k *
    log2(e)``, or with ``SOFTCAP`` ``c * tanh(scale * q.k / c) * log2(e)`` (both c and the scale
    times log2(e) here, so their ratio is scale / c)."""
    s = tl.dot(q, k, input_precision=DOT_PREC)
    if SOFTCAP:
        return softcapped(s, qk_scale / cap, cap)
    return s * qk_scale


@triton.jit
def softcapped(x, ratio, cap):
    """``cap * tanh(x * ratio)``. tanh from exp2 (the interpreter has no libdevice tanh):
    tanh(y) = 1 - 2 / (e^2y + 1), within a few 1e-7 of it absolutely (what the softmax feels,
    once times the cap; the relative error near 0 is larger and does not matter there); where
    exp2 overflows to inf or underflows to 0 it gives +-1, not NaN."""
    e2y = tl.exp2(x * (ratio * _TWO_LOG2E))
    return cap - 2.0 * cap / (e2y + 1.0)
