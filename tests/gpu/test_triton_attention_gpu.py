"""Triton attention kernels at real model shapes on a CUDA GPU (``pytest -m gpu``).

Kernel modules are imported inside the tests: importing them at collection time on a CPU machine
would define the kernels compiled, before tests/unit/test_triton_attention.py can ask for the
interpreter.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BLOCK_SIZES = [16, 32]
# (query heads, KV heads, head size): Qwen2.5-0.5B, Llama-3.1-8B
SHAPES = [(14, 2, 64), (32, 8, 128)]
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}
# (window, softcap): Mistral-7B-v0.1's and Gemma 2's window (4,096), Gemma 3's local one (1,024,
# cutting blocks and tiles), and a softcap of 2 (the scores of these random inputs are about
# N(0, 1): Gemma 2's 50 would hardly bend them), alone and with a window
WINDOW_OPTIONS = [(4096, 0.0), (1024, 0.0), (0, 2.0), (1000, 2.0)]


@pytest.fixture(autouse=True)
def _no_cudnn_sdpa() -> Any:
    """cuDNN's SDPA recompiles for every new KV length (see FACTS); the torch reference backend
    must not use it."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def make_cache(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(KVCacheView of layer 1 of a 3-layer random pool, the pool, block tables)."""
    from baton_kernels.attention import KVCacheView

    rng = random.Random(0)
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 8
    pool = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, device="cuda")
    pool = pool.to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(blocks)
    tables = torch.tensor(
        [
            [free.pop() for _ in range(n)] + [rng.randrange(num_blocks)] * (width - n)
            for n in blocks
        ],
        device="cuda",
    )
    return KVCacheView(pool[:, 1]), pool, tables


def qkv_view(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    wide = torch.randn(num_tokens, num_heads + 4, head_dim, device="cuda").to(dtype)
    return wide[:, :num_heads]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_write_kv_cache(dtype: torch.dtype, block_size: int) -> None:
    from baton_kernels.attention import KVCacheView
    from baton_kernels.triton.kv_write import ref_write_kv_cache, write_kv_cache

    torch.manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 4096, 8, 128
    num_blocks = num_tokens // block_size + 16
    pool = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, device="cuda")
    pool = pool.to(dtype)
    want = pool.clone()
    key = qkv_view(num_tokens, num_kv_heads, head_dim, dtype)
    value = qkv_view(num_tokens, num_kv_heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slot_block, slot_offset = slots // block_size, slots % block_size
    slot_block[::97] = -1
    write_kv_cache(key, value, KVCacheView(pool[:, 1]), slot_block, slot_offset)
    ref_write_kv_cache(key, value, KVCacheView(want[:, 1]), slot_block, slot_offset)
    torch.testing.assert_close(pool, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_attention(dtype: torch.dtype, block_size: int, shape: tuple[int, int, int]) -> None:
    from baton_kernels.triton.decode_attention import (
        choose_num_splits,
        decode_attention,
        ref_decode_attention,
    )

    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim = shape
    rng = random.Random(1)
    seq_lens = [1, 2, 63, 64, 65, 4097, 8192] + [rng.randrange(1, 6000) for _ in range(25)]
    cache, _, tables = make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    query = qkv_view(len(seq_lens), num_heads, head_dim, dtype)
    lens = torch.tensor(seq_lens, device="cuda")
    want = ref_decode_attention(query, cache, seq_lens, tables, head_dim**-0.5)
    auto = choose_num_splits(len(seq_lens), num_kv_heads, max(seq_lens), query.device)
    for num_splits in sorted({1, 3, 16, auto}):
        out = torch.full_like(query, float("nan"))
        decode_attention(query, cache, out, lens, tables, head_dim**-0.5, num_splits)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("window", "softcap"), WINDOW_OPTIONS)
def test_decode_attention_with_window_and_softcap(
    dtype: torch.dtype,
    block_size: int,
    shape: tuple[int, int, int],
    window: int,
    softcap: float,
) -> None:
    """Requests shorter than the window, as long and longer, over split counts whose slices
    start at the window's first key (mid-block, mid-tile)."""
    from baton_kernels.triton.decode_attention import (
        choose_num_splits,
        decode_attention,
        ref_decode_attention,
    )

    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim = shape
    rng = random.Random(1)
    seq_lens = [1, 2, 63, 1000, 1001, 1024, 1025, 4095, 4096, 4097, 8192]
    seq_lens += [rng.randrange(1, 9000) for _ in range(21)]
    cache, _, tables = make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    query = qkv_view(len(seq_lens), num_heads, head_dim, dtype)
    lens = torch.tensor(seq_lens, device="cuda")
    scale = head_dim**-0.5
    want = ref_decode_attention(query, cache, seq_lens, tables, scale, window, softcap)
    keys = min(window, max(seq_lens)) if window else max(seq_lens)
    auto = choose_num_splits(len(seq_lens), num_kv_heads, keys, query.device)
    for num_splits in sorted({1, 3, 16, auto}):
        for fuse_reduce in (True, False):
            out = torch.full_like(query, float("nan"))
            decode_attention(query, cache, out, lens, tables, scale, num_splits, window=window,
                             softcap=softcap, fuse_reduce=fuse_reduce)  # fmt: skip
            atol, rtol = TOL[dtype]
            torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 16])
def test_decode_rope_with_window(dtype: torch.dtype, num_splits: int) -> None:
    """``rope`` under a window (Llama-3.1-8B's shape): the program of the window's last slice
    writes the new token's rotated K and V before any reads them; out and cache equal the
    rotary kernel's write followed by the reference."""
    from baton_engine.models.rotary import RotaryEmbedding
    from baton_kernels.attention import KVCacheView
    from baton_kernels.triton.decode_attention import (
        DecodeRope,
        decode_attention,
        ref_decode_attention,
    )
    from baton_kernels.triton.fused_ops import rotary_embedding_and_write_kv_

    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim = SHAPES[1]
    window, block_size = 1000, 16
    seq_lens = [1, 999, 1000, 1001, 3000, 8192, 5555, 64]
    cache, pool, tables = make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    n = len(seq_lens)
    pos = torch.tensor(seq_lens, device="cuda") - 1
    slot_block = tables[torch.arange(n, device="cuda"), pos // block_size]
    slot_offset = pos % block_size
    slot_block[2] = -1  # a padding row: nothing written
    query = qkv_view(n, num_heads, head_dim, dtype)
    key = qkv_view(n, num_kv_heads, head_dim, dtype)
    value = qkv_view(n, num_kv_heads, head_dim, dtype)
    cos_sin = RotaryEmbedding(head_dim, 8192, 10000.0, None).to("cuda").cos_sin
    want_pool = pool.clone()
    want_cache = KVCacheView(want_pool[:, 1])
    want_q, want_k = query.clone(), key.clone()
    rotary_embedding_and_write_kv_(
        want_q, want_k, value, pos, cos_sin, want_cache.kv, slot_block, slot_offset
    )
    want = ref_decode_attention(want_q, want_cache, seq_lens, tables, 0.1, window, 2.0)
    out = torch.full_like(query, float("nan"))
    rope = DecodeRope(pos, cos_sin, key, value, slot_block, slot_offset)
    decode_attention(query, cache, out, pos + 1, tables, 0.1, num_splits, window=window,
                     softcap=2.0, rope=rope)  # fmt: skip
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(pool, want_pool, atol=atol, rtol=rtol)
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", SHAPES)
def test_paged_attention_mixed_batch(
    dtype: torch.dtype, block_size: int, shape: tuple[int, int, int]
) -> None:
    check_paged_attention_mixed_batch(dtype, block_size, shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("window", "softcap"), WINDOW_OPTIONS)
def test_paged_attention_mixed_batch_with_window_and_softcap(
    dtype: torch.dtype,
    block_size: int,
    shape: tuple[int, int, int],
    window: int,
    softcap: float,
) -> None:
    """Windows of 1,024 and 1,000 keys start inside the chunks over context and the 512-token
    fresh ones, cutting tiles (skipped, masked, seen whole by every row); one of 4,096 cuts
    nothing here (the windowed kernel where every key is seen)."""
    check_paged_attention_mixed_batch(dtype, block_size, shape, window, softcap)


def check_paged_attention_mixed_batch(
    dtype: torch.dtype,
    block_size: int,
    shape: tuple[int, int, int],
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    from baton_kernels.triton.paged_attention import paged_attention, ref_paged_attention

    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim = shape
    # decodes, fresh prefills, chunks over long context
    specs = [(100, 1)] * 8 + [(0, 512), (0, 7), (2048, 512), (1500, 333), (4000, 64), (31, 1)]
    seq_lens = [c + n for c, n in specs]
    qsl = [0]
    for _, n in specs:
        qsl.append(qsl[-1] + n)
    cache, _, tables = make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    query = qkv_view(qsl[-1], num_heads, head_dim, dtype)
    out = torch.full_like(query, float("nan"))
    paged_attention(
        query,
        cache,
        out,
        torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        tables,
        head_dim**-0.5,
        max(n for _, n in specs),
        window=window,
        softcap=softcap,
    )
    want = ref_paged_attention(query, cache, qsl, seq_lens, tables, head_dim**-0.5, window, softcap)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (256, 0.0), (1024, 2.0)])
def test_backend_matches_torch_backend(
    shape: tuple[int, int, int], window: int, softcap: float
) -> None:
    """Both backends over one mixed step, each writing the new K/V into its own copy (with a
    layer's window and softcap: the torch backend masks and caps its own way)."""
    from baton_kernels.attention import AttentionMetadata, KVCacheView, create_attention_backend

    torch.manual_seed(0)
    dtype, block_size = torch.bfloat16, 16
    num_heads, num_kv_heads, head_dim = shape
    specs = [(37, 1), (700, 1), (2000, 1), (0, 300), (0, 300), (513, 77)]
    seq_lens = [c + n for c, n in specs]
    cache, pool, tables = make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    qsl, slot_block, slot_offset = [0], [], []
    for i, (cached, new) in enumerate(specs):
        qsl.append(qsl[-1] + new)
        for pos in range(cached, cached + new):
            slot_block.append(int(tables[i, pos // block_size]))
            slot_offset.append(pos % block_size)
    num_decodes = 3
    max_decode_blocks = math.ceil(max(seq_lens[:num_decodes]) / block_size)
    invalid = (
        torch.arange(max_decode_blocks * block_size, device="cuda")[None, :]
        >= torch.tensor(seq_lens[:num_decodes], device="cuda")[:, None]
    )
    bias = torch.zeros(invalid.shape, dtype=dtype, device="cuda").masked_fill_(invalid, -math.inf)
    md = AttentionMetadata(
        num_reqs=len(specs),
        num_decodes=num_decodes,
        num_tokens=qsl[-1],
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_block=torch.tensor(slot_block, device="cuda"),
        slot_offset=torch.tensor(slot_offset, device="cuda"),
        decode_bias=bias.view(num_decodes, 1, 1, -1),
        max_decode_blocks=max_decode_blocks,
        decode_seq_lens=torch.tensor(seq_lens[:num_decodes], device="cuda"),
    )
    query = qkv_view(qsl[-1], num_heads, head_dim, dtype)
    key = qkv_view(qsl[-1], num_kv_heads, head_dim, dtype)
    value = qkv_view(qsl[-1], num_kv_heads, head_dim, dtype)
    pool_ref = pool.clone()
    triton_backend = create_attention_backend("triton", "cuda", dtype=dtype, head_dim=head_dim)
    options = {"window": window, "softcap": softcap}
    out = triton_backend.forward(query, key, value, cache, md, head_dim**-0.5, **options)
    want = create_attention_backend("torch", "cuda").forward(
        query, key, value, KVCacheView(pool_ref[:, 1]), md, head_dim**-0.5, **options
    )
    torch.testing.assert_close(pool, pool_ref, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (1000, 2.0)])
def test_decode_replays_in_a_cuda_graph(window: int, softcap: float) -> None:
    """Captured once with a fixed split count, the decode replays correctly for new lengths and
    block tables written into the same buffers (with a window: over the window's keys)."""
    from baton_kernels.triton.decode_attention import decode_attention, ref_decode_attention

    torch.manual_seed(0)
    dtype, block_size, (num_heads, num_kv_heads, head_dim) = torch.bfloat16, 16, SHAPES[0]
    max_len, batch = 4096, 8
    cache, _, tables = make_cache([max_len] * batch, block_size, num_kv_heads, head_dim, dtype)
    query = qkv_view(batch, num_heads, head_dim, dtype)
    lens = torch.full((batch,), 100, device="cuda")
    out = torch.empty_like(query)
    options = {"window": window, "softcap": softcap}
    decode_attention(query, cache, out, lens, tables, 0.125, 8, **options)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(query, cache, out, lens, tables, 0.125, 8, **options)
    for seq_lens in ([1, 5, 17, 300, 999, 4096, 2048, 64], [4000] * batch):
        lens.copy_(torch.tensor(seq_lens))
        tables.copy_(tables[torch.randperm(batch, device="cuda")])
        out.fill_(float("nan"))
        graph.replay()
        want = ref_decode_attention(query, cache, seq_lens, tables, 0.125, window, softcap)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (700, 2.0)])
def test_backend_decode_step_replays_in_a_cuda_graph(window: int, softcap: float) -> None:
    """A decode-only step (lengths on the device) through the backend — K/V write, split decode,
    reduce — captured once and replayed with new tokens, lengths and slots (a layer with a
    window shorter than the captured length: its own split count)."""
    from baton_kernels.attention import AttentionMetadata, create_attention_backend
    from baton_kernels.triton.decode_attention import ref_decode_attention

    torch.manual_seed(0)
    dtype, block_size, (num_heads, num_kv_heads, head_dim) = torch.bfloat16, 16, SHAPES[1]
    batch, max_len = 4, 2048
    cache, _, tables = make_cache([max_len] * batch, block_size, num_kv_heads, head_dim, dtype)
    query = qkv_view(batch, num_heads, head_dim, dtype)
    key = qkv_view(batch, num_kv_heads, head_dim, dtype)
    value = qkv_view(batch, num_kv_heads, head_dim, dtype)
    lens = torch.full((batch,), 10, device="cuda")
    slot_block = tables[:, 0].clone()
    slot_offset = torch.full((batch,), 9, device="cuda")
    md = AttentionMetadata(
        num_reqs=batch,
        num_decodes=batch,
        num_tokens=batch,
        query_start_loc=list(range(batch + 1)),
        seq_lens=[max_len] * batch,
        block_tables=tables,
        slot_block=slot_block,
        slot_offset=slot_offset,
        decode_bias=None,
        max_decode_blocks=max_len // block_size,
        decode_seq_lens=lens,
    )
    backend = create_attention_backend("triton", "cuda", dtype=dtype, head_dim=head_dim)
    options = {"window": window, "softcap": softcap}
    backend.forward(query, key, value, cache, md, 0.125, **options)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(query, key, value, cache, md, 0.125, **options)
    for seq_lens in ([1, 700, 2048, 33], [1999, 16, 17, 1024]):
        lens.copy_(torch.tensor(seq_lens))
        pos = torch.tensor(seq_lens, device="cuda") - 1
        slot_block.copy_(tables[torch.arange(batch, device="cuda"), pos // block_size])
        slot_offset.copy_(pos % block_size)
        for t in (query, key, value):
            t.copy_(torch.randn(t.shape, device="cuda").to(dtype))
        graph.replay()
        written = cache.kv[slot_block, :, slot_offset]
        torch.testing.assert_close(written, torch.stack([key, value], 1), atol=0, rtol=0)
        want = ref_decode_attention(query, cache, seq_lens, tables, 0.125, window, softcap)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 1000])
def test_fused_split_reduce_matches_separate_reduce_across_replays(
    shape: tuple[int, int, int], window: int
) -> None:
    """Back-to-back decode launches sharing the fused reduce's counters, captured in one graph
    (as a model's layers are) and replayed with new lengths: each equals the two-kernel path
    (with a window, both count the window's slices)."""
    from baton_kernels.triton.common import zeroed_counters
    from baton_kernels.triton.decode_attention import decode_attention

    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim = shape
    batch, max_len, layers, splits = 3, 3000, 12, 16
    cache, _, tables = make_cache([max_len] * batch, 16, num_kv_heads, head_dim, torch.float32)
    queries = [qkv_view(batch, num_heads, head_dim, torch.float32) for _ in range(layers)]
    outs = [torch.empty_like(q) for q in queries]
    lens = torch.full((batch,), 100, device="cuda")

    scale = head_dim**-0.5

    def run_layers() -> None:
        for q, o in zip(queries, outs, strict=True):
            decode_attention(
                q, cache, o, lens, tables, scale, splits, window=window, fuse_reduce=True
            )

    run_layers()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_layers()
    rng = random.Random(2)
    for _ in range(20):
        lens.copy_(torch.tensor([rng.randrange(1, max_len + 1) for _ in range(batch)]))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        for q, o in zip(queries, outs, strict=True):
            want = torch.full_like(q, float("nan"))
            decode_attention(
                q, cache, want, lens, tables, scale, splits, window=window, fuse_reduce=False
            )
            torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)
    assert (
        int(
            zeroed_counters(
                queries[0].device, batch * num_kv_heads, "decode_attention"
            ).count_nonzero()
        )
        == 0
    )
