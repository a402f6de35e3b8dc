"""Attention backends and CPU ops against plain-PyTorch references (``ref_*``)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from baton_kernels.attention import AttentionMetadata, KVCacheView, create_attention_backend
from baton_kernels.attention.base import FP8_KV_DTYPES, to_cache_dtype
from baton_kernels.attention.torch_backend import as_cached

DTYPES = [torch.float32, torch.bfloat16]
HEAD_SIZES = [64, 128, 256]  # (256: Gemma 2 and 3)
BLOCK_SIZES = [4, 16]
NUM_LAYERS = 3  # the pool is block-major over layers; the test uses the middle one
BACKENDS = ["torch", "cpu"]  # "cpu" is the C++ decode kernel; CI builds it (gcc, ninja)
# and "cpu-tiles": the CPU backend with prompts in its tiles on AMX CPUs too (they take SDPA)
WITH_TILES = [*BACKENDS, "cpu-tiles"]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def ref_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions of a sequence over all ``len(k)``;
    with ``window``, over the last ``window`` positions up to each query's; with ``softcap``,
    the scores capped by ``softcap * tanh(score / softcap)``."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    keys = torch.arange(seq_len)[None, :]
    scores.masked_fill_(keys > pos, -math.inf)
    if window:
        scores.masked_fill_(keys <= pos - window, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_step(
    seq_specs: list[tuple[int, int]],
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    kv_dtype: torch.dtype | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[AttentionMetadata, KVCacheView, list[torch.Tensor], list[torch.Tensor]]:
    """seq_specs: (num_cached, num_new) per request, decodes (num_new == 1) first. Fills the
    cache (of ``kv_dtype``, default ``dtype``; an 8-bit one's K and V ``scales``) with the
    cached tokens' K/V at random blocks; returns metadata and each request's full K and V
    (cached + new) for the reference."""
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim)
    pool = torch.zeros(shape, dtype=kv_dtype or dtype)
    cache = KVCacheView(pool[:, 1], *scales)
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    max_blocks = max(-(-(c + n) // block_size) for c, n in seq_specs)
    tables = torch.zeros(len(seq_specs), max_blocks, dtype=torch.int64)
    ks, vs, slot_block, slot_offset, qsl, seq_lens = [], [], [], [], [0], []
    for i, (cached, new) in enumerate(seq_specs):
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        for t in range(total):
            if t < cached:
                slot = blocks[t // block_size], t % block_size
                cache.key[slot] = to_cache_dtype(k[t], pool.dtype, scales[0])
                cache.value[slot] = to_cache_dtype(v[t], pool.dtype, scales[1])
            else:
                slot_block.append(blocks[t // block_size])
                slot_offset.append(t % block_size)
        ks.append(k)
        vs.append(v)
        qsl.append(qsl[-1] + new)
        seq_lens.append(total)
    num_decodes = sum(1 for _, n in seq_specs if n == 1)
    decode_bias = None
    max_decode_blocks = 0
    if num_decodes:
        max_decode_blocks = max(-(-s // block_size) for s in seq_lens[:num_decodes])
        invalid = (
            torch.arange(max_decode_blocks * block_size)[None, :]
            >= torch.tensor(seq_lens[:num_decodes])[:, None]
        )
        decode_bias = torch.zeros(invalid.shape, dtype=dtype).masked_fill_(invalid, -math.inf)
        decode_bias = decode_bias.view(num_decodes, 1, 1, -1)
    md = AttentionMetadata(
        num_reqs=len(seq_specs),
        num_decodes=num_decodes,
        num_tokens=qsl[-1],
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_block=torch.tensor(slot_block),
        slot_offset=torch.tensor(slot_offset),
        decode_bias=decode_bias,
        max_decode_blocks=max_decode_blocks,
        # as the model runner passes them: the CPU backend's decode kernel needs them
        decode_seq_lens=torch.tensor(seq_lens[:num_decodes]) if num_decodes else None,
    )
    return md, cache, ks, vs


@pytest.mark.parametrize("backend", WITH_TILES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_backend_matches_reference(
    backend: str, dtype: torch.dtype, head_dim: int, block_size: int
) -> None:
    num_heads, num_kv_heads = 6, 2
    check_backend(backend, dtype, head_dim, block_size, num_heads, num_kv_heads)


@pytest.mark.parametrize("backend", WITH_TILES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (7, 1), (10, 2)])
def test_backend_matches_reference_for_each_gqa_group(
    backend: str, num_heads: int, num_kv_heads: int
) -> None:
    """Query heads per KV head of 1, 4, 7 (Qwen2.5) and 5 (the C++ decode kernel has compiled
    group sizes and a general one)."""
    check_backend(backend, torch.bfloat16, 64, 16, num_heads, num_kv_heads)


@pytest.mark.parametrize("backend", WITH_TILES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_only_batch_with_long_cached_prefixes(backend: str, dtype: torch.dtype) -> None:
    """No decodes: fresh prompts and chunks after long cached prefixes (chunked prefill, a
    prefix-cache hit), each new token attending up to its own position; the C++ kernel tiles
    chunks of 8 tokens or more (several work units past 128) and takes shorter ones row by
    row."""
    specs = [(0, 37), (300, 40), (0, 2), (517, 3), (16, 16), (200, 300)]
    check_backend(backend, dtype, 64, 16, 9, 3, specs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(8, 0.0), (0, 3.0), (21, 2.5), (1, 0.0)])
def test_sliding_window_and_softcap(
    backend: str,
    dtype: torch.dtype,
    window: int,
    softcap: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gemma 2's local layers and Mistral-7B-v0.1: each query sees the last ``window``
    positions up to its own; Gemma 2's scores capped by ``softcap * tanh(s / softcap)``.
    Decodes, fresh prompts (batched) and chunks after cached context, longer and shorter than
    the window; queries scaled up so that the cap changes the result. The CPU backend runs
    them in its kernels: decodes always, prompts in bf16 where the tiles run (float32 prompts
    take the reference, with or without these options)."""
    if backend == "cpu":
        refuse_reference(monkeypatch, prompts=dtype == torch.bfloat16)
    specs = [(0, 1), (7, 1), (40, 1), (130, 1), (0, 30), (0, 30), (0, 5), (12, 6), (90, 40)]
    check_backend(backend, dtype, 64, 16, 6, 2, specs, window, softcap)


def refuse_reference(monkeypatch: pytest.MonkeyPatch, prompts: bool) -> None:
    """Makes the reference backend's decode (and with ``prompts``, all of its attention) an
    error, so that a CPU backend test passes through the C++ kernels only (prompts in the tiles
    on AMX CPUs too, where they would take SDPA)."""
    from baton_kernels.attention import cpu_backend, torch_backend
    from baton_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    assert ops is not None

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the CPU backend ran the reference")

    monkeypatch.setattr(torch_backend.TorchAttentionBackend, "_decode", refuse)
    if prompts and ops.bf16_gemm_available():  # (the tiles: AVX512-BF16 CPUs only)
        monkeypatch.setattr(torch_backend, "attention", refuse)
        monkeypatch.setattr(cpu_backend, "SDPA_PROMPTS_ON_AMX", False)


def check_backend(
    backend: str,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    specs: list[tuple[int, int]] | None = None,
    window: int = 0,
    softcap: float = 0.0,
    kv_dtype: torch.dtype | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """The backend's output against ``ref_attention`` over each request's K/V as the cache
    holds them (rounded to an 8-bit ``kv_dtype``, with its ``scales``), and the new K/V in
    their slots."""
    # decodes (various lengths), fresh prefills of equal length (batched), fresh of another
    # length, and chunks with cached context
    if specs is None:
        specs = [(0, 1), (7, 1), (40, 1), (130, 1), (0, 9), (0, 9), (0, 5), (12, 6), (33, 17)]
    md, cache, ks, vs = build_step(
        specs, block_size, 128, dtype, head_dim, num_heads, num_kv_heads, kv_dtype, scales
    )
    cached = cache.kv.dtype
    ks = [as_cached(k, cached, scales[0]) for k in ks]  # (unchanged but for an 8-bit cache)
    vs = [as_cached(v, cached, scales[1]) for v in vs]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(md.num_tokens, num_heads, head_dim, generator=gen)
    q = (q * 4 if softcap else q).to(dtype)  # (scores of several units: the cap bends them)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(ks, specs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(vs, specs, strict=True)])
    scale = head_dim**-0.5
    attn = create_attention_backend(backend.removesuffix("-tiles"), kv_dtype=kv_dtype)
    if backend == "cpu-tiles":
        attn.sdpa_prompts = False  # type: ignore[attr-defined]
    out = attn.forward(q, new_k, new_v, cache, md, scale, window=window, softcap=softcap)
    rtol, atol = TOL[dtype]
    for i in range(md.num_reqs):
        s, e = md.query_start_loc[i], md.query_start_loc[i + 1]
        want = ref_attention(q[s:e], ks[i], vs[i], scale, window, softcap)
        torch.testing.assert_close(out[s:e].float(), want, rtol=rtol, atol=atol)
    # and the new tokens' K/V landed in their slots
    slots = md.slot_block, md.slot_offset
    assert torch.equal(cache.key[slots], to_cache_dtype(new_k, cached, scales[0]))
    assert torch.equal(cache.value[slots], to_cache_dtype(new_v, cached, scales[1]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (21, 2.5)])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (3.0, 0.1)])
def test_backend_with_an_8bit_cache(
    backend: str,
    kv_dtype: torch.dtype,
    dtype: torch.dtype,
    window: int,
    softcap: float,
    scales: tuple[float, float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--kv-cache-dtype fp8`` / ``fp8_e5m2``: the new K/V are stored divided by the layer's
    scales, rounded to the 8-bit float (bit for bit the reference's rounding), and every query
    (decodes, fresh prompts, chunks after cached context) attends to the K/V as the cache holds
    them, times the scales. The CPU backend runs its kernels (decodes always, prompts in bf16
    where the tiles run)."""
    if backend == "cpu":
        refuse_reference(monkeypatch, prompts=dtype == torch.bfloat16)
    specs = [(0, 1), (7, 1), (40, 1), (130, 1), (0, 30), (0, 30), (0, 5), (12, 6), (90, 40)]
    check_backend(backend, dtype, 64, 16, 6, 2, specs, window, softcap, kv_dtype, scales)


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (7, 1), (10, 2)])
def test_cpu_backend_with_an_8bit_cache_for_each_gqa_group(
    kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C++ kernels' compiled group sizes and their general one, over an 8-bit cache."""
    refuse_reference(monkeypatch, prompts=True)
    check_backend(
        "cpu", torch.bfloat16, 64, 16, num_heads, num_kv_heads, kv_dtype=kv_dtype,
        scales=(0.5, 2.0),
    )  # fmt: skip


def test_an_8bit_cache_saturates_what_it_cannot_hold() -> None:
    """Values beyond the 8-bit float's range are stored as its largest finite value (torch's
    cast alone would store NaN in e4m3), as vLLM's FP8 cache writes saturate."""
    x = torch.tensor([1000.0, -1e6, 3.0, 448.0, 7e4], dtype=torch.bfloat16)
    e4m3 = to_cache_dtype(x, torch.float8_e4m3fn).float()
    assert e4m3.tolist() == [448.0, -448.0, 3.0, 448.0, 448.0]
    e5m2 = to_cache_dtype(x, torch.float8_e5m2).float()
    assert e5m2.tolist() == [1024.0, -57344.0, 3.0, 448.0, 57344.0]


def test_auto_picks_the_cpu_kernels_for_an_8bit_cache() -> None:
    for kv_dtype in FP8_KV_DTYPES:
        backend = create_attention_backend("auto", "cpu", dtype=torch.bfloat16, kv_dtype=kv_dtype)
        assert backend.name == "cpu"


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_cpu_8bit_cache_writes_round_as_the_reference(
    kv_dtype: torch.dtype, dtype: torch.dtype, scale: float
) -> None:
    """``write_kv_cache_`` into an 8-bit cache stores bit for bit what the reference stores:
    values past the format's range saturate, ties round to even, subnormals and signed zeros
    keep their value, each of K and V divided by its own scale."""
    from baton_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    assert ops is not None
    top = torch.finfo(kv_dtype).max
    tiny = torch.finfo(kv_dtype).smallest_normal
    special = [0.0, -0.0, top, -top, 2 * top, -1e9, tiny, tiny / 8, tiny / 3, -tiny / 5, 1e-30]
    step = 0.125 if kv_dtype == torch.float8_e4m3fn else 0.25  # (between 1 and 2)
    ties = 1.0 + (torch.arange(8) * 2 + 1) * step / 2  # halfway between two values
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn(5 * 2 * 64 - len(special) - len(ties), generator=gen) * 40
    rows = torch.cat([torch.tensor(special), ties, noise]).view(5, 2, 64).to(dtype)
    key, value = rows, -rows.flip(0)
    kv = torch.zeros(3, 2, 4, 2, 64, dtype=kv_dtype)
    blocks, offsets = torch.tensor([2, 0, 2, 1, 0]), torch.tensor([3, 0, 1, 2, 1])
    ops.write_kv_cache_(key, value, kv, blocks, offsets, scale, 2 * scale)
    bits = kv.view(torch.uint8)
    want_k = to_cache_dtype(key, kv_dtype, scale).view(torch.uint8)
    want_v = to_cache_dtype(value, kv_dtype, 2 * scale).view(torch.uint8)
    assert torch.equal(bits[blocks, 0, offsets], want_k)
    assert torch.equal(bits[blocks, 1, offsets], want_v)


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernels_read_every_8bit_value_exactly(
    kv_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    """A sequence of one token attends to its V alone: the output is the cache's value times
    V's scale, for each of the 256 bytes (subnormals, zeros, the largest values; e4m3's NaN
    and e5m2's infinities and NaNs stay so), in the decode kernel and the prompt rows."""
    from baton_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    assert ops is not None
    kv = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(1, 1, 1, 4, 64)
    kv = kv.expand(2, 2, 16, 4, 64).contiguous().view(kv_dtype)  # every row: all 256 bytes
    kv[:, 0] = to_cache_dtype(torch.full((2, 16, 4, 64), 0.5), kv_dtype)  # (finite keys)
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    tables = torch.tensor([[1], [0], [1]])
    v_scale = 4.0  # (a power of 2: the product is exact in either dtype)
    want = (kv[1, 1, 0].float() * v_scale).repeat_interleave(2, dim=0)  # [8 heads, 64]
    decode = ops.paged_decode_attention(
        q, kv[:, 0], kv[:, 1], tables, torch.tensor([1, 1, 1]), 0.125, 0, 0.0, 3.0, v_scale
    )
    prompt = ops.paged_attention(
        q, kv[:, 0], kv[:, 1], tables, torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2, 3]),
        0.125, 0, 0.0, 3.0, v_scale,
    )  # fmt: skip
    for out in (decode, prompt):
        for row in out:
            torch.testing.assert_close(row.float(), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_on_amx_cpus_prompts_take_sdpa_unless_a_window_or_softcap(
    kv_dtype: torch.dtype | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the CPU has AMX, the CPU backend sends prompts without a window or softcap to the
    reference's SDPA (oneDNN on the tiles: faster than the tiles' VDPBF16PS there) and keeps
    decodes in the C++ kernel; with a window or softcap the whole batch stays in the kernels.
    Over the model's cache and an FP8 one (scaled), the results are the reference's."""
    from baton_kernels.attention import torch_backend
    from baton_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    assert ops is not None
    backend = create_attention_backend("cpu")
    assert backend.sdpa_prompts == bool(ops.amx_gemm_available())  # type: ignore[attr-defined]
    if not ops.amx_gemm_available():
        pytest.skip("no AMX on this CPU")
    sdpa_calls = 0
    sdpa = torch_backend.attention

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal sdpa_calls
        sdpa_calls += 1
        return sdpa(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_backend, "attention", counting)
    specs = [(0, 1), (7, 1), (40, 1), (0, 9), (0, 9), (12, 6)]
    scales = (0.5, 2.0) if kv_dtype else (1.0, 1.0)
    check_backend("cpu", torch.bfloat16, 64, 16, 6, 2, specs, 0, 0.0, kv_dtype, scales)
    assert sdpa_calls == 2  # the two fresh 9-token prompts batched, the chunk; no decode
    sdpa_calls = 0
    check_backend("cpu", torch.bfloat16, 64, 16, 6, 2, specs, 8, 0.0, kv_dtype, scales)
    assert sdpa_calls == 0


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("nope")


def test_auto_picks_the_cpu_kernel_on_cpu_and_triton_on_cuda() -> None:
    assert create_attention_backend("auto", "cpu").name == "cpu"
    on_cuda = "triton" if torch.cuda.is_available() else "torch"  # triton needs a GPU there
    assert create_attention_backend("auto", "cuda").name == on_cuda


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_paged_attention_op_matches_reference(dtype: torch.dtype) -> None:
    """The op itself in both dtypes (the backend sends it bf16 prompt batches only): decodes,
    short chunks row by row and long ones in tiles, over cached prefixes."""
    from baton_kernels.attention.torch_backend import write_kv_cache
    from baton_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    assert ops is not None
    specs = [(9, 1), (0, 37), (300, 40), (0, 2), (517, 3), (200, 150)]
    md, cache, ks, vs = build_step(specs, 16, 160, dtype, 64, 9, 3)
    q = torch.randn(md.num_tokens, 9, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(ks, specs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(vs, specs, strict=True)])
    write_kv_cache(new_k, new_v, cache, md)
    out = ops.paged_attention(
        q, cache.key, cache.value, md.block_tables, torch.tensor(md.seq_lens),
        torch.tensor(md.query_start_loc), 0.125,
    )  # fmt: skip
    rtol, atol = TOL[dtype]
    for i in range(md.num_reqs):
        s, e = md.query_start_loc[i], md.query_start_loc[i + 1]
        want = ref_attention(q[s:e], ks[i], vs[i], 0.125)
        torch.testing.assert_close(out[s:e].float(), want, rtol=rtol, atol=atol)


# Windows shorter than a block and a tile (5), one tile (16), cutting through tiles and blocks
# (37, 100; longer than some sequences), longer than every sequence (1000: the ops take the path
# without one) and of one token (1); the softcap alone and with a window.
WINDOW_SOFTCAP = [(5, 0.0), (16, 0.0), (37, 0.0), (100, 0.0), (1000, 0.0), (1, 0.0),
                  (0, 2.5), (37, 2.5)]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (7, 1)])
@pytest.mark.parametrize(("window", "softcap"), WINDOW_SOFTCAP)
def test_cpu_attention_ops_window_and_softcap(
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    window: int,
    softcap: float,
) -> None:
    """The ops themselves with a sliding window and a softcap, GQA groups of 1, 4 and 7:
    ``paged_attention`` over decodes, chunks shorter than 8 tokens (row by row) and longer ones
    (in tiles in bf16 on AVX512-BF16; rows in float32), fresh and after cached context, over
    several work units past 128 tokens; ``paged_decode_attention`` over the decodes. The keys
    that a window puts out of reach are NaN in the cache, so a kernel that reads them fails:
    decodes and row-by-row chunks must start at their window exactly, the tiles at the key tile
    holding their first row's window start."""
    from baton_kernels.attention.torch_backend import write_kv_cache
    from baton_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    assert ops is not None
    specs = [(9, 1), (300, 1), (0, 37), (300, 40), (0, 2), (517, 3), (200, 150), (0, 260)]
    block_size = 16
    md, cache, ks, vs = build_step(specs, block_size, 200, dtype, head_dim, num_heads, num_kv_heads)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(md.num_tokens, num_heads, head_dim, generator=gen)
    q = (q * 4 if softcap else q).to(dtype)  # (scores of several units: the cap bends them)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(ks, specs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(vs, specs, strict=True)])
    write_kv_cache(new_k, new_v, cache, md)
    tiles = dtype == torch.bfloat16 and bool(ops.bf16_gemm_available())
    for i, (cached, new) in enumerate(specs):
        # The first key any of the request's rows sees; a tiled chunk reads from its tile.
        first = max(0, cached - window + 1) if window else 0
        if tiles and new >= 8:
            first -= first % 16
        for t in range(first):
            block = int(md.block_tables[i, t // block_size])
            cache.key[block, t % block_size] = float("nan")
            cache.value[block, t % block_size] = float("nan")
    scale = head_dim**-0.5
    out = ops.paged_attention(
        q, cache.key, cache.value, md.block_tables, torch.tensor(md.seq_lens),
        torch.tensor(md.query_start_loc), scale, window, softcap,
    )  # fmt: skip
    nd = md.num_decodes
    decode_out = ops.paged_decode_attention(
        q[:nd], cache.key, cache.value, md.block_tables[:nd], torch.tensor(md.seq_lens[:nd]),
        scale, window, softcap,
    )  # fmt: skip
    rtol, atol = TOL[dtype]
    for i in range(md.num_reqs):
        s, e = md.query_start_loc[i], md.query_start_loc[i + 1]
        want = ref_attention(q[s:e], ks[i], vs[i], scale, window, softcap)
        torch.testing.assert_close(out[s:e].float(), want, rtol=rtol, atol=atol)
        if i < nd:
            torch.testing.assert_close(decode_out[s:e].float(), want, rtol=rtol, atol=atol)


def test_cpu_paged_attention_rejects_inconsistent_metadata() -> None:
    """The in-place kernel reads the cache through the tables: a table or length that points
    outside it is an error, not a read of foreign memory."""
    from baton_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    assert ops is not None
    kv = torch.randn(8, 2, 16, 2, 64).to(torch.bfloat16)
    q = torch.randn(5, 4, 64).to(torch.bfloat16)
    tables = torch.tensor([[1, 2], [3, 4]])

    def call(
        tables: torch.Tensor, seq_lens: list[int], starts: list[int], window: int = 0
    ) -> torch.Tensor:
        out: torch.Tensor = ops.paged_attention(
            q, kv[:, 0], kv[:, 1], tables, torch.tensor(seq_lens), torch.tensor(starts), 0.125,
            window,
        )  # fmt: skip
        return out

    assert call(tables, [3, 20], [0, 3, 5]).shape == q.shape
    with pytest.raises(RuntimeError, match="query_start_loc must run from 0 to 5"):
        call(tables, [3, 20], [0, 3, 4])
    with pytest.raises(RuntimeError, match="3 query tokens in a sequence of 2"):
        call(tables, [2, 20], [0, 3, 5])
    with pytest.raises(RuntimeError, match="row 3 attends to 39 tokens; its block table holds 32"):
        call(tables, [3, 40], [0, 3, 5])
    with pytest.raises(RuntimeError, match="block id 9 outside the cache of 8 blocks"):
        call(torch.tensor([[1, 2], [9, 4]]), [3, 20], [0, 3, 5])
    with pytest.raises(RuntimeError, match="block id -1 outside the cache"):
        ops.paged_decode_attention(q[:2], kv[:, 0], kv[:, 1], torch.tensor([[1], [-1]]),
                                   torch.tensor([4, 4]), 0.125)  # fmt: skip
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ops.paged_decode_attention(q[:2], kv[:, 0], kv[:, 1], tables, torch.tensor([4, 4]),
                                   0.125, -1, 0.0)  # fmt: skip
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        ops.paged_attention(q, kv[:, 0], kv[:, 1], tables, torch.tensor([3, 20]),
                            torch.tensor([0, 3, 5]), 0.125, 0, -1.0)  # fmt: skip
    # A window leaves the blocks before it unread: their table entries are not checked.
    window_only = torch.tensor([[1, 2], [-1, 4]])
    assert call(window_only, [3, 20], [0, 3, 5], window=3).shape == q.shape
    with pytest.raises(RuntimeError, match="block id -1 outside the cache"):
        call(window_only, [3, 20], [0, 3, 5], window=4)  # (reaches token 15, in block -1)
