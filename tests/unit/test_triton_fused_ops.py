"""Fused Triton elementwise kernels (rotary, silu-and-mul, add + RMSNorm) against their
plain-PyTorch references and against the Llama model's current torch code paths.

Without a GPU the kernels run under Triton's interpreter at small shapes; TRITON_INTERPRET is set
before any kernel module is imported (see test_triton_attention.py). With a GPU the same tests run
compiled, on the device.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from baton_engine.models.llama import RMSNorm
from baton_engine.models.rotary import RotaryEmbedding
from baton_kernels.attention.base import KVCacheView
from baton_kernels.triton import fused_ops
from baton_kernels.triton.fused_ops import (
    fused_add_rms_norm,
    gelu_tanh_and_mul,
    head_rms_norm_,
    ref_fused_add_rms_norm,
    ref_gelu_tanh_and_mul,
    ref_head_rms_norm,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
    rms_norm,
    rotary_embedding_,
    rotary_embedding_and_write_kv_,
    silu_and_mul,
)
from baton_kernels.triton.kv_write import ref_write_kv_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NUM_TOKENS = [1, 5, 17]
# (atol, rtol). The kernels compute in fp32 and round once; the torch paths round intermediates
# to the dtype as well (and the interpreter truncates fp32 -> bf16), so 16-bit results differ by
# about one unit in the last place.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (1e-3, 1e-3)}
# The torch rotary rounds both products and their sum to fp16; where they nearly cancel, that is
# up to about 2e-3 off the exact result, which the fp32 kernel is closer to.
ROPE_TOL = {**TOL, torch.float16: (2e-3, 1e-3)}
MAX_POSITIONS = 512
EPS = 1e-6
POISON = float("nan")


def assert_close(
    got: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype,
    tol: dict[torch.dtype, tuple[float, float]] = TOL,
) -> None:
    assert got.dtype == want.dtype == dtype
    atol, rtol = tol[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def shuffled_positions(num_tokens: int, start: int = 100) -> torch.Tensor:
    """Distinct positions from ``start`` on, not sorted (for more than one token)."""
    perm = torch.randperm(num_tokens)
    if num_tokens > 1 and bool((perm[1:] > perm[:-1]).all()):
        perm = perm.flip(0)
    return (perm * 7 + start).to(DEVICE)


# --------------------------------------------------------------------------------------------
# rotary embedding

ROPE_SHAPES = [  # (tokens, query heads, key heads, head_dim)
    *[(t, 14, 2, 64) for t in NUM_TOKENS],  # Qwen2.5-0.5B
    (1, 4, 1, 128),  # Llama-like GQA, few tokens
    (5, 4, 1, 128),
]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def fused_qkv(
    num_tokens: int, hq: int, hk: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random fused projection output and its q, k, v views, as Attention.forward splits it."""
    qkv = randn(num_tokens, (hq + 2 * hk) * dim, dtype=dtype)
    q, k, v = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    return (
        qkv,
        q.view(num_tokens, hq, dim),
        k.view(num_tokens, hk, dim),
        v.view(num_tokens, hk, dim),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
def test_rotary_in_place_on_fused_qkv(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    num_tokens, hq, hk, dim = shape
    scaling = LLAMA3_SCALING if dim == 128 else None
    rope = RotaryEmbedding(dim, MAX_POSITIONS, 10000.0, scaling).to(DEVICE)
    qkv, q, k, v = fused_qkv(num_tokens, hq, hk, dim, dtype)
    if num_tokens > 1:  # views of the fused rows (a single token's views have no token stride)
        assert q.stride(0) == k.stride(0) == (hq + 2 * hk) * dim
    positions = shuffled_positions(num_tokens)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    want_q, want_k = ref_rotary_embedding(q0, k0, positions, rope.cos_sin)
    tables = rope(positions, dtype)  # the model's code path
    model_q, model_k = tables.apply(q0), tables.apply(k0)

    rotary_embedding_(q, k, positions, rope.cos_sin)

    assert_close(q, want_q, dtype, ROPE_TOL)
    assert_close(k, want_k, dtype, ROPE_TOL)
    assert_close(q, model_q, dtype, ROPE_TOL)
    assert_close(k, model_k, dtype, ROPE_TOL)
    assert torch.equal(v, v0)  # the V part of the fused tensor is untouched
    # written through the views into the fused tensor
    assert_close(qkv[:, : hq * dim].view(num_tokens, hq, dim), want_q, dtype, ROPE_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("tokens", [1, None])
def test_rotary_and_kv_write_in_one_launch(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    tokens: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode path's rotary + cache write: q and k rotated in place as by rotary_embedding_,
    the rotated K and the V rows in the cache at each token's slot, padding tokens (block -1)
    not written, and nothing else in the cache touched; with one token a program or as many
    as fit (``ROPE_TOKENS``: 4 for Qwen's heads, 8 for the 128-dim shape; 5 and 17 tokens end
    on a partial program)."""
    from baton_kernels.triton import fused_ops

    monkeypatch.setattr(fused_ops, "ROPE_TOKENS", tokens)
    torch.manual_seed(1)
    num_tokens, hq, hk, dim = shape
    rope = RotaryEmbedding(dim, MAX_POSITIONS, 10000.0, None).to(DEVICE)
    _, q, k, v = fused_qkv(num_tokens, hq, hk, dim, dtype)
    positions = shuffled_positions(num_tokens)
    pool = randn(24, 3, 2, 4, hk, dim, dtype=dtype)  # [blocks, layers, K/V, block_size, ...]
    cache = KVCacheView(pool[:, 1])
    slot_block = torch.randperm(24)[:num_tokens].to(DEVICE)
    slot_block[-1] = -1  # a padding token of a CUDA-graph batch
    slot_offset = torch.randint(0, 4, (num_tokens,)).to(DEVICE)
    want_q, want_k = ref_rotary_embedding(q.clone(), k.clone(), positions, rope.cos_sin)
    want_pool = pool.clone()
    ref_write_kv_cache(want_k, v, KVCacheView(want_pool[:, 1]), slot_block, slot_offset)

    rotary_embedding_and_write_kv_(
        q, k, v, positions, rope.cos_sin, cache.kv, slot_block, slot_offset
    )

    assert_close(q, want_q, dtype, ROPE_TOL)
    assert_close(k, want_k, dtype, ROPE_TOL)
    written = slot_block >= 0
    got_k = cache.kv[slot_block[written], 0, slot_offset[written]]
    assert_close(got_k, want_k[written], dtype, ROPE_TOL)
    assert torch.equal(cache.kv[slot_block[written], 1, slot_offset[written]], v[written])
    untouched = torch.ones(pool.shape[:1] + pool.shape[2:4], dtype=torch.bool, device=DEVICE)
    untouched[slot_block[written], :, slot_offset[written]] = False
    assert torch.equal(pool[:, 1][untouched], want_pool[:, 1][untouched])
    assert torch.equal(pool[:, 0], want_pool[:, 0]) and torch.equal(pool[:, 2], want_pool[:, 2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_rotary_and_kv_write_apply_a_folded_norm(
    shape: tuple[int, int, int, int], dtype: torch.dtype, with_bias: bool
) -> None:
    """``norm_of``: q, k and v are a qkv projection's outputs, without its bias, whose weight
    holds the RMSNorm's (``fold_norms``, prompt steps): each token's q, k and v are multiplied
    by the 1/rms of its ``norm_of`` row and given the bias (rounded as the unfolded
    projection's output), then q and k rotated as without it, and K and V written."""
    torch.manual_seed(6)
    num_tokens, hq, hk, dim = shape
    rope = RotaryEmbedding(dim, MAX_POSITIONS, 10000.0, None).to(DEVICE)
    _, q, k, v = fused_qkv(num_tokens, hq, hk, dim, dtype)
    scales = torch.arange(1, num_tokens + 1, device=DEVICE)[:, None].to(dtype)
    stream = randn(num_tokens, 96, dtype=dtype) * scales  # rows of different norms
    bias = randn(hq + 2 * hk, dim, dtype=dtype) if with_bias else None
    positions = shuffled_positions(num_tokens)
    pool = randn(24, 2, 4, hk, dim, dtype=dtype)
    slot_block = torch.randperm(24)[:num_tokens].to(DEVICE)
    slot_offset = torch.randint(0, 4, (num_tokens,)).to(DEVICE)

    rstd = torch.rsqrt(stream.float().pow(2).mean(-1) + 1e-5)[:, None, None]
    b = bias.float() if bias is not None else torch.zeros(hq + 2 * hk, dim, device=DEVICE)
    want_q, want_k, want_v = (
        (x.float() * rstd + part).to(dtype)
        for x, part in ((q, b[:hq]), (k, b[hq : hq + hk]), (v, b[hq + hk :]))
    )
    want_q, want_k = ref_rotary_embedding(want_q, want_k, positions, rope.cos_sin)
    want_pool = pool.clone()
    ref_write_kv_cache(want_k, want_v, KVCacheView(want_pool), slot_block, slot_offset)

    rotary_embedding_and_write_kv_(
        q, k, v, positions, rope.cos_sin, pool, slot_block, slot_offset, norm_of=stream,
        eps=1e-5, bias=bias,
    )  # fmt: skip

    # q and v are rounded once more than in test_rotary_and_kv_write_in_one_launch
    atol, rtol = ROPE_TOL[dtype]
    for got, want in ((q, want_q), (k, want_k), (pool, want_pool)):
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=2 * rtol)


def test_rotary_and_kv_write_rejects_misuse() -> None:
    _, q, k, v = fused_qkv(3, 4, 2, 64, torch.float32)
    cos_sin = RotaryEmbedding(64, MAX_POSITIONS, 10000.0, None).to(DEVICE).cos_sin
    positions = torch.arange(3, device=DEVICE)
    kv = randn(4, 2, 4, 2, 64, dtype=torch.float32)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="cache must be"):
        rotary_embedding_and_write_kv_(q, k, v, positions, cos_sin, kv[:, 0], slots, slots)
    with pytest.raises(ValueError, match="cache dtype"):
        rotary_embedding_and_write_kv_(q, k, v, positions, cos_sin, kv.half(), slots, slots)
    with pytest.raises(ValueError, match="slot_block"):
        rotary_embedding_and_write_kv_(q, k, v, positions, cos_sin, kv, slots[:2], slots)
    stream = randn(3, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="norm_of"):
        rotary_embedding_and_write_kv_(
            q, k, v, positions, cos_sin, kv, slots, slots, norm_of=stream[:2]
        )
    with pytest.raises(ValueError, match="bias must be"):
        rotary_embedding_and_write_kv_(
            q, k, v, positions, cos_sin, kv, slots, slots, norm_of=stream, bias=stream
        )
    with pytest.raises(ValueError, match="only with norm_of"):
        rotary_embedding_and_write_kv_(
            q, k, v, positions, cos_sin, kv, slots, slots, bias=randn(8, 64, dtype=torch.float32)
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_contiguous_and_other_head_dims(dtype: torch.dtype) -> None:
    """Separate contiguous q/k, int32 positions, a head dim whose half is not a power of two, and
    as many key heads as query heads."""
    torch.manual_seed(1)
    for num_tokens, hq, hk, dim in [(3, 3, 3, 96), (2, 2, 1, 16)]:
        rope = RotaryEmbedding(dim, MAX_POSITIONS, 1e6).to(DEVICE)
        q, k = randn(num_tokens, hq, dim, dtype=dtype), randn(num_tokens, hk, dim, dtype=dtype)
        positions = shuffled_positions(num_tokens, start=MAX_POSITIONS - 3 * 7).to(torch.int32)
        want_q, want_k = ref_rotary_embedding(q, k, positions.long(), rope.cos_sin)
        rotary_embedding_(q, k, positions, rope.cos_sin)
        assert_close(q, want_q, dtype, ROPE_TOL)
        assert_close(k, want_k, dtype, ROPE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_several_head_blocks(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Programs of two heads each: seven query-head blocks, then the key heads' block."""
    monkeypatch.setattr(fused_ops, "ROPE_MAX_ELEMS", 2 * 64)
    torch.manual_seed(6)
    rope = RotaryEmbedding(64, MAX_POSITIONS, 1e6).to(DEVICE)
    _, q, k, v = fused_qkv(5, 14, 2, 64, dtype)
    v0 = v.clone()
    positions = shuffled_positions(5)
    want_q, want_k = ref_rotary_embedding(q, k, positions, rope.cos_sin)
    rotary_embedding_(q, k, positions, rope.cos_sin)
    assert_close(q, want_q, dtype, ROPE_TOL)
    assert_close(k, want_k, dtype, ROPE_TOL)
    assert torch.equal(v, v0)


def test_rotary_position_zero_is_identity_and_no_tokens_is_a_no_op() -> None:
    rope = RotaryEmbedding(64, 16, 10000.0).to(DEVICE)
    q, k = randn(2, 3, 64, dtype=torch.float32), randn(2, 1, 64, dtype=torch.float32)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding_(q, k, torch.zeros(2, dtype=torch.int64, device=DEVICE), rope.cos_sin)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    empty = q[:0]
    rotary_embedding_(empty, k[:0], torch.zeros(0, dtype=torch.int64, device=DEVICE), rope.cos_sin)


def test_rotary_rejects_misuse() -> None:
    rope = RotaryEmbedding(64, 16, 10000.0).to(DEVICE)
    table = rope.cos_sin
    q, k = randn(3, 4, 64, dtype=torch.bfloat16), randn(3, 2, 64, dtype=torch.bfloat16)
    pos = torch.arange(3, device=DEVICE)
    bad = [
        (q.flatten(1), k, pos, table),  # not [T, heads, D]
        (q, k[:2], pos, table),  # token counts differ
        (q, randn(3, 2, 32, dtype=torch.bfloat16), pos, table),  # head dims differ
        (q, k.float(), pos, table),  # dtypes differ
        (q.to(torch.int16), k.to(torch.int16), pos, table),  # not a float dtype
        (q, k, pos.float(), table),  # positions not integers
        (q, k, pos[:2], table),  # positions of another length
        (q, k, pos, table[:, 0]),  # not [P, 2, D]
        (q, k, pos, RotaryEmbedding(32, 16, 10000.0).cos_sin.to(DEVICE)),  # table for another D
        (randn(3, 4, 63, dtype=torch.float32), randn(3, 2, 63, dtype=torch.float32), pos, table),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            rotary_embedding_(*args)


# --------------------------------------------------------------------------------------------
# silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("inter", [64, 1500])  # 1500: two column blocks, the last one masked
def test_silu_and_mul(num_tokens: int, inter: int, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    x = randn(num_tokens, 2 * inter, dtype=dtype) * 3
    out = torch.full((num_tokens, inter), POISON, dtype=dtype, device=DEVICE)
    got = silu_and_mul(x, out=out)
    assert got is out
    gate, up = x.split(inter, dim=-1)  # the model's code path
    assert_close(got, ref_silu_and_mul(x), dtype)
    assert_close(got, F.silu(gate) * up, dtype)
    assert_close(silu_and_mul(x), got, dtype)  # allocating its own output


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1500])
def test_gelu_tanh_and_mul(inter: int, dtype: torch.dtype) -> None:
    """Gemma's GeGLU: the same kernel with GELU's tanh form (as a sigmoid) for SiLU."""
    torch.manual_seed(5)
    x = randn(5, 2 * inter, dtype=dtype) * 3
    out = torch.full((5, inter), POISON, dtype=dtype, device=DEVICE)
    got = gelu_tanh_and_mul(x, out=out)
    assert got is out
    gate, up = x.split(inter, dim=-1)
    assert_close(got, ref_gelu_tanh_and_mul(x), dtype)
    assert_close(got, F.gelu(gate, approximate="tanh") * up, dtype)
    assert not torch.allclose(got.float(), ref_silu_and_mul(x).float(), atol=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_strided_input(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    wide = randn(4, 2 * 80 + 7, dtype=dtype)
    x = wide[:, 3 : 3 + 2 * 80]
    assert not x.is_contiguous()
    assert_close(silu_and_mul(x), ref_silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_loop", [False, True])
def test_silu_and_mul_applies_a_folded_norm(
    dtype: torch.dtype, row_loop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``norm_of``: gate and up are a gate/up projection's outputs whose weight holds the
    RMSNorm's (``fold_norms``); each row is multiplied by the 1/rms of its ``norm_of`` row
    (rounded as the projection's output) before SiLU-and-multiply, in every column block; with
    one program a row looping over the blocks (``row_loop``: prompt steps' row counts) or one
    per row and block."""
    monkeypatch.setattr(fused_ops, "SILU_ROW_LOOP_MIN_ROWS", 1 if row_loop else 1 << 30)
    torch.manual_seed(4)
    x = randn(5, 2 * 1500, dtype=dtype) * 3
    stream = randn(5, 96, dtype=dtype) * torch.arange(1, 6, device=DEVICE)[:, None].to(dtype)
    out = torch.full((5, 1500), POISON, dtype=dtype, device=DEVICE)
    got = silu_and_mul(x, out=out, norm_of=stream, eps=1e-5)
    rstd = torch.rsqrt(stream.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    gate, up = (x.float() * rstd).to(dtype).split(1500, dim=-1)
    # gate and up are each rounded once more than in test_silu_and_mul (where the interpreter
    # truncates, one ulp off torch's rounding): twice its relative tolerance
    atol, rtol = TOL[dtype]
    for want in (F.silu(gate) * up, ref_silu_and_mul(x, stream, 1e-5)):
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=2 * rtol)
    assert not torch.allclose(got.float(), ref_silu_and_mul(x).float(), atol=0.1)
    with pytest.raises(ValueError, match="norm_of"):
        silu_and_mul(x, norm_of=stream[:4])
    with pytest.raises(ValueError, match="norm_of"):
        silu_and_mul(x, norm_of=stream.t().contiguous().t())


def test_silu_and_mul_rejects_misuse() -> None:
    x = randn(3, 8, dtype=torch.float16)
    for bad_x in (x[:, :7], x.flatten(), x.long()):
        with pytest.raises(ValueError):
            silu_and_mul(bad_x)
    for bad_out in (torch.empty(3, 8, dtype=torch.float16), torch.empty(3, 4, dtype=torch.float32)):
        with pytest.raises(ValueError):
            silu_and_mul(x, out=bad_out.to(DEVICE))


# --------------------------------------------------------------------------------------------
# residual add + RMSNorm


def norm_inputs(
    num_tokens: int, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = randn(num_tokens, hidden, dtype=dtype)
    residual = randn(num_tokens, hidden, dtype=dtype) * 4
    weight = (1 + 0.3 * torch.randn(hidden, device=DEVICE)).to(dtype)
    return x, residual, weight


def model_norm(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    norm = RMSNorm(weight.shape[0], EPS).to(device=DEVICE, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(hidden)  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden", [576, 896])
def test_fused_add_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    x, residual, weight = norm_inputs(num_tokens, hidden, dtype)
    x0, residual0 = x.clone(), residual.clone()
    want_normed, want_residual = ref_fused_add_rms_norm(x, residual, weight, EPS)
    model_residual = residual0 + x0  # DecoderLayer: hidden = hidden + attn_out, then the norm
    model_normed = model_norm(weight, model_residual)
    out = torch.full((num_tokens, hidden), POISON, dtype=dtype, device=DEVICE)

    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS, out=out)

    assert normed is out and new_residual is residual  # the sum is written in place
    assert torch.equal(x, x0)
    assert_close(new_residual, want_residual, dtype)
    assert_close(new_residual, model_residual, dtype)
    assert_close(normed, want_normed, dtype)
    assert_close(normed, model_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_wide_and_strided(dtype: torch.dtype) -> None:
    """A Llama-8B-wide row in one program, a strided view of the input, and rms_norm alone."""
    torch.manual_seed(5)
    x, residual, weight = norm_inputs(2, 4096, dtype)
    want_normed, want_residual = ref_fused_add_rms_norm(x, residual, weight, EPS)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert_close(new_residual, want_residual, dtype)
    assert_close(normed, want_normed, dtype)

    wide = randn(3, 896 + 10, dtype=dtype)
    xs, w = wide[:, 5 : 5 + 896], weight[:896]
    out = torch.full((3, 896), POISON, dtype=dtype, device=DEVICE)
    assert rms_norm(xs, w, EPS, out=out) is out
    assert_close(out, ref_rms_norm(xs, w, EPS), dtype)
    assert_close(out, model_norm(w, xs), dtype)


def test_fused_add_rms_norm_rejects_misuse() -> None:
    x, residual, weight = norm_inputs(3, 64, torch.bfloat16)
    bad = [
        (x, residual[:2], weight),  # residual of another shape
        (x, residual.float(), weight),  # residual of another dtype
        (x, residual, weight[:32]),  # weight of another size
        (x, residual, weight.float()),  # weight of another dtype
        (x.view(3, 2, 32), residual.view(3, 2, 32), weight[:32]),  # not [tokens, hidden]
        (x.long(), residual.long(), weight.long()),  # not a float dtype
    ]
    for x_, r_, w_ in bad:
        with pytest.raises(ValueError):
            fused_add_rms_norm(x_, r_, w_, EPS)
    with pytest.raises(ValueError):
        fused_add_rms_norm(x, residual, weight, EPS, out=torch.empty_like(x[:, :32]))
    with pytest.raises(ValueError):
        rms_norm(x, weight.half(), EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "q_heads", "kv_heads", "head_dim"), [
    (1, 14, 2, 64), (5, 32, 4, 128), (17, 4, 4, 80), (3, 40, 8, 64),
    (2, 4, 1, 256),  # (Gemma 3's heads: its q/k norms' (1 + weight) is summed at load time)
])  # fmt: skip
def test_head_rms_norm_in_place_on_the_projection(
    num_tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Qwen3's q/k norms in one launch on the strided q and k views of a qkv projection's
    output: each head normed as the model's ``RMSNorm`` modules norm it, v untouched."""
    torch.manual_seed(head_dim + q_heads)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype) * 3
    q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, q_heads, head_dim)
    k = k.view(num_tokens, kv_heads, head_dim)
    q_w = (1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype)
    k_w = (1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype)
    v0 = v.clone()
    want_q, want_k = ref_head_rms_norm(q, k, q_w, k_w, EPS)
    model_q, model_k = model_norm(q_w, q.clone()), model_norm(k_w, k.clone())
    head_rms_norm_(q, k, q_w, k_w, EPS)
    assert torch.equal(v, v0)
    assert_close(q, want_q, dtype)
    assert_close(k, want_k, dtype)
    assert_close(q, model_q, dtype)
    assert_close(k, model_k, dtype)


def test_head_rms_norm_rejects_misuse() -> None:
    q = randn(2, 4, 64, dtype=torch.bfloat16)
    k = randn(2, 2, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous heads"):
        head_rms_norm_(q.transpose(1, 2), k, w, w, EPS)
    with pytest.raises(ValueError, match="weight"):
        head_rms_norm_(q, k, w[:32], w, EPS)
    with pytest.raises(ValueError, match="weight"):
        head_rms_norm_(q, k, w, w.float(), EPS)
    with pytest.raises(ValueError, match="do not match"):
        head_rms_norm_(q, k[:1], w, w, EPS)
    with pytest.raises(ValueError, match="dtype"):
        head_rms_norm_(q.double(), k.double(), w.double(), w.double(), EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 5), (3, 4096), (4, 9000)])
def test_argmax_matches_torch_across_chunks(dtype: torch.dtype, rows: int, vocab: int) -> None:
    """Each row's argmax, its maximum planted in a different chunk per row, equals torch's; the
    per-row counters are left at zero for the next launch."""
    from baton_kernels.triton.common import zeroed_counters

    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    for r in range(rows):  # far from any other logit, so rounding cannot move it
        logits[r, (r * 4099 + 3) % vocab] = 50.0
    logits = logits.to(DEVICE)
    for _ in range(2):
        got = fused_ops.argmax(logits)
        assert got.dtype == torch.int64
        assert got.tolist() == logits.argmax(dim=-1).tolist()
        assert int(zeroed_counters(DEVICE, rows, "argmax")[:rows].count_nonzero()) == 0


def test_argmax_ties_go_to_the_first_index_and_nan_wins() -> None:
    """Ties within a chunk and across chunks pick the first index; a NaN is the largest and an
    all -inf row gives index 0, as torch.argmax does."""
    logits = torch.zeros(4, 9000)
    logits[0, [7000, 100, 5000]] = 3.0  # across chunks
    logits[1, [40, 41]] = 3.0  # within one
    logits[2, 8000] = float("nan")
    logits[3] = float("-inf")
    logits = logits.to(DEVICE)
    assert fused_ops.argmax(logits).tolist() == [100, 40, 8000, 0]


def test_argmax_rejects_misuse() -> None:
    with pytest.raises(ValueError, match="contiguous rows"):
        fused_ops.argmax(torch.zeros(4, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="contiguous rows"):
        fused_ops.argmax(torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="empty vocabulary"):
        fused_ops.argmax(torch.zeros(2, 0, device=DEVICE))
    assert fused_ops.argmax(torch.zeros(0, 8, device=DEVICE)).shape == (0,)
