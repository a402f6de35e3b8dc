"""The C++ fused ops of the CPU path (csrc/fused_ops_cpu.cpp) against the torch ops they replace
in the model: residual add + RMSNorm, rotary on q and k in place, SiLU-and-multiply. They round
where torch rounds, so bf16 results agree to the last bit but for float evaluation order."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from baton_engine.models.rotary import RotaryEmbedding
from baton_kernels import fused
from baton_kernels.cpu_ops import load_cpu_ops

pytestmark = pytest.mark.skipif(load_cpu_ops() is None, reason="the CPU kernels did not build")

CPU = torch.device("cpu")
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, tokens: int) -> None:
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 576).to(dtype)
    residual = torch.randn(tokens, 576).to(dtype)
    weight = (1 + 0.1 * torch.randn(576)).to(dtype)
    want_residual = residual + x
    want = F.rms_norm(want_residual, (576,), weight, 1e-5)
    got, got_residual = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert got_residual.data_ptr() == residual.data_ptr()  # updated in place
    assert torch.equal(residual, want_residual)
    close(got, want, dtype)
    if dtype == torch.bfloat16:  # one rounding, as torch: nearly every element is exact
        assert (got == want).float().mean() > 0.98
    first, same = fused.add_rms_norm(x, None, weight, 1e-5)  # the first layer: no residual yet
    assert same is x
    close(first, F.rms_norm(x, (576,), weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (14, 2, 64), (4, 1, 128)])
def test_rotary_rotates_qk_views_in_place_like_the_torch_path(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    torch.manual_seed(dim + heads)
    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(tokens, heads, dim)
    k = k.view(tokens, kv_heads, dim)
    v_before = v.clone()
    positions = torch.tensor([5, 0, 300, 17, 17, 2, 1023, 64, 9, 8, 100])
    rope = RotaryEmbedding(dim, 1024, 10000.0)
    want_q, want_k = rope(positions, dtype).apply_qk(q.clone(), k.clone())
    fused.rotary_embedding_(q, k, positions, rope.cos_sin)
    close(q, want_q, dtype)
    close(k, want_k, dtype)
    assert torch.equal(v, v_before)
    if dtype == torch.bfloat16:
        assert (q == want_q).float().mean() > 0.98


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    x = (3 * torch.randn(9, 2 * 1536)).to(dtype)
    gate, up = x.split(1536, dim=-1)
    want = F.silu(gate) * up
    got = fused.silu_and_mul(x)
    close(got, want, dtype)
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.98


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_matches_torch(dtype: torch.dtype) -> None:
    """Gemma's GeGLU: torch's tanh-approximated GELU of the gate times up, rounded where torch
    rounds; across the GELU's whole range (large negative gates: 0, near 0: ~x / 2)."""
    torch.manual_seed(4)
    x = (3 * torch.randn(9, 2 * 1536)).to(dtype)
    x[0, :8] = torch.tensor([-60.0, -9.0, -1e-3, 0.0, 1e-3, 9.0, 60.0, -0.5]).to(dtype)
    gate, up = x.split(1536, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    got = fused.gelu_tanh_and_mul(x)
    close(got, want, dtype)
    assert not torch.allclose(got.float(), (F.silu(gate) * up).float(), atol=0.1)
    if dtype == torch.bfloat16:
        # torch's bf16 GELU rounds differently from its float32 one (~7% of values here):
        # the kernel is to be as often as torch the exact value's rounding (its own
        # activation, before the product's rounding)
        ones = torch.cat([gate, torch.ones_like(up)], dim=-1)
        exact = F.gelu(gate.double(), approximate="tanh").to(dtype)
        ours = (fused.gelu_tanh_and_mul(ones) == exact).float().mean()
        theirs = (F.gelu(gate, approximate="tanh") == exact).float().mean()
        assert ours >= theirs and ours > 0.98


def test_bad_input_is_a_clear_error() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="weight must be"):
        fused.add_rms_norm(x, None, torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused.silu_and_mul(x.half())
    with pytest.raises(RuntimeError, match="positions must be"):
        fused.rotary_embedding_(
            x.view(4, 1, 64), x.view(4, 1, 64).clone(), torch.zeros(3, dtype=torch.long),
            torch.zeros(8, 2, 64),
        )  # fmt: skip


def test_default_cpu_engine_uses_the_fused_ops(default_model_dir: object) -> None:
    from baton_engine.config import EngineConfig
    from baton_engine.core.engine_core import EngineCore

    core = EngineCore(
        EngineConfig(model=str(default_model_dir), max_model_len=256, kv_cache_memory=16 << 20)
    )
    assert core.runner.backend.name == "cpu" and core.runner.model.fused_rope
    reference = EngineCore(
        EngineConfig(
            model=str(default_model_dir),
            max_model_len=256,
            kv_cache_memory=16 << 20,
            attention_backend="torch",
        )
    )
    assert not reference.runner.model.fused_rope


def test_kernels_run_on_every_intra_op_thread() -> None:
    """The module is built with OpenMP: without it ``at::parallel_for`` compiles to a plain loop
    and every kernel (attention, norms, rotary, SiLU) runs on one thread, however many torch
    uses (it did, until the build passed -fopenmp)."""
    ops = load_cpu_ops()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (make test's workers run one thread each on 2 cores)
    try:
        assert ops.parallel_threads(64 * 2) == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_matches_the_reference_into_the_block_major_pool(dtype: torch.dtype) -> None:
    """The CPU backend's C++ row copy puts new K/V (views of a fused qkv output) where the
    reference's index_put does, in one layer of the engine's block-major pool, and nowhere else."""
    from baton_kernels.attention.base import AttentionMetadata, KVCacheView
    from baton_kernels.attention.cpu_backend import CpuAttentionBackend
    from baton_kernels.attention.torch_backend import TorchAttentionBackend

    torch.manual_seed(0)
    blocks, layers, block_size, kv_heads, dim, tokens = 9, 3, 16, 3, 64, 21
    pool = torch.randn(blocks, layers, 2, block_size, kv_heads, dim).to(dtype)
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * dim).to(dtype)
    _, k, v = qkv.split([9 * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * block_size)[:tokens]

    def metadata(slot_block: torch.Tensor) -> AttentionMetadata:  # one prefill chunk
        return AttentionMetadata(
            num_reqs=1,
            num_decodes=0,
            num_tokens=tokens,
            query_start_loc=[0, tokens],
            seq_lens=[tokens],
            block_tables=torch.zeros(1, blocks, dtype=torch.int64),
            slot_block=slot_block,
            slot_offset=slots % block_size,
            decode_bias=None,
            max_decode_blocks=0,
        )

    md = metadata(slots // block_size)
    want = pool.clone()
    TorchAttentionBackend()._write_kv(k, v, KVCacheView(want[:, 1]), md)
    CpuAttentionBackend(load_cpu_ops())._write_kv(k, v, KVCacheView(pool[:, 1]), md)
    assert torch.equal(pool, want)
    md = metadata(torch.full((tokens,), blocks))  # past the pool
    with pytest.raises(RuntimeError, match="outside the cache"):
        CpuAttentionBackend(load_cpu_ops())._write_kv(k, v, KVCacheView(pool[:, 1]), md)
    assert torch.equal(pool, want)  # checked before anything was written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152 + 7])
def test_argmax_matches_torch_with_ties_nans_and_infinities(dtype: torch.dtype, vocab: int) -> None:
    """The greedy path's argmax: first index of the maximum (ties are common in bf16), the
    first NaN where a row has one, -inf rows, negative rows, and rows of a wider tensor."""
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(8, vocab + 5, generator=gen).to(dtype)
    x = wide[:, 2 : 2 + vocab]  # row stride vocab + 5
    x[1] = x[1].abs().neg() - 1  # all negative
    x[2] = -math.inf
    if vocab > 3:
        x[3, 1] = x[3, vocab - 2] = x[3].max() + 1  # a tie: the first wins
        x[4, vocab // 2] = math.nan
        x[4, vocab - 1] = math.nan
        x[5, 0] = math.inf
        x[5, vocab - 1] = math.inf
    got = fused.argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()
