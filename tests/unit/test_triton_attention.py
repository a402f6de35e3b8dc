"""Triton attention kernels and the backend registry against plain-PyTorch references.

Without a GPU the kernels run under Triton's interpreter at small shapes. Triton decides between
compiling and interpreting when a kernel is defined, so TRITON_INTERPRET is set here before any
kernel module is imported (tests/gpu imports them only inside its tests, for the same reason).
With a GPU the same tests run compiled, on the device.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
import triton
import triton.language as tl

from baton_kernels.attention import (
    AttentionMetadata,
    KVCacheView,
    available_backends,
    create_attention_backend,
)
from baton_kernels.attention.base import FP8_KV_DTYPES
from baton_kernels.attention.triton_backend import TritonAttentionBackend
from baton_kernels.triton.common import softcapped
from baton_kernels.triton.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_launch,
    decode_launches,
    ref_decode_attention,
    split_counts,
)
from baton_kernels.triton.fused_ops import ref_rotary_embedding
from baton_kernels.triton.kv_write import ref_write_kv_cache, write_kv_cache
from baton_kernels.triton.paged_attention import (
    PrefillConfig,
    paged_attention,
    ref_paged_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_SIZES = [64, 128]
BLOCK_SIZES = [16, 32]
GQA = [(7, 1), (8, 2)]  # (query heads, KV heads): Qwen2.5-0.5B's ratio of 7, and 4
# (atol, rtol) against an fp32 reference computed from the same rounded inputs: the 16-bit
# outputs carry one rounding of the result (the interpreter truncates, so up to one ulp)
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
NUM_LAYERS = 3  # the pool is block-major over layers; tests use the middle layer's strided view
POISON = float("nan")


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def random_heads(num_tokens: int, num_heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Random ``[num_tokens, num_heads, dim]`` that is a strided view, like q/k/v split from a
    fused projection."""
    wide = torch.randn(num_tokens, num_heads + 3, dim, device=DEVICE).to(dtype)
    return wide[:, 1 : 1 + num_heads]


class PagedBatch:
    """Requests' K/V scattered over random blocks of one layer of a random-filled pool."""

    def __init__(
        self,
        seq_lens: list[int],
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int = 0,
        kv_dtype: torch.dtype | None = None,  # the pool's (default ``dtype``)
    ) -> None:
        torch.manual_seed(seed)
        rng = random.Random(seed)
        blocks_per_req = [-(s // -block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_req) + 4
        shape = (num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim)
        self.pool = torch.randn(shape, device=DEVICE).to(kv_dtype or dtype)
        self.cache = KVCacheView(self.pool[:, 1])
        free = list(range(num_blocks))
        rng.shuffle(free)
        width = max(blocks_per_req) + 2
        # padding entries point at real blocks, so reading past a request's end would show
        self.block_tables = torch.tensor(
            [[free.pop() for _ in range(n)] + [rng.randrange(num_blocks)] * (width - n)
             for n in blocks_per_req],
            dtype=torch.int64,
            device=DEVICE,
        )  # fmt: skip
        self.seq_lens = seq_lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(
    ("kv_dtype", "scales"),
    [
        (None, (1.0, 1.0)),
        *[(t, (1.0, 1.0)) for t in FP8_KV_DTYPES],
        (FP8_KV_DTYPES[0], (2.0, 0.25)),
    ],
)
def test_write_kv_cache_matches_reference(
    dtype: torch.dtype, block_size: int, kv_dtype: torch.dtype | None, scales: tuple[float, float]
) -> None:
    """The new K/V in their slots, nothing else touched; into an 8-bit cache (``kv_dtype``)
    what ``to_cache_dtype`` stores, bit for bit: divided by the layer's scales, rounded to
    nearest (even), and saturated beyond the 8-bit float's range."""
    torch.manual_seed(0)
    num_blocks, num_kv_heads, head_dim, num_tokens = 12, 2, 64, 23
    shape = (num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim)
    pool = torch.randn(shape).to(kv_dtype or dtype).to(DEVICE)
    want = pool.clone()
    key = random_heads(num_tokens, num_kv_heads, head_dim, dtype)
    value = random_heads(num_tokens, num_kv_heads, head_dim, dtype)
    if kv_dtype is not None:  # beyond e4m3's 448 (and e5m2's 57,344)
        key[0, 0, :4] = torch.tensor([1000.0, -6e4, 6e4, 0.3])
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slot_block = (slots // block_size).to(DEVICE)
    slot_block[5] = -1  # a padding token: written nowhere
    slot_offset = (slots % block_size).to(DEVICE)
    write_kv_cache(key, value, KVCacheView(pool[:, 1], *scales), slot_block, slot_offset)
    ref_write_kv_cache(key, value, KVCacheView(want[:, 1], *scales), slot_block, slot_offset)
    # (as bytes: an 8-bit float's -0.0 and 0.0 differ; other layers untouched too)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))
    assert not pool.float().isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
def test_paged_attention_matches_reference(
    dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    # (cached, new) per request: decodes, a fresh prefill spanning several q-blocks, chunks over
    # context longer than a 64-key tile (so the unmasked-tile loop runs) and shorter than a block
    specs = [(0, 1), (37, 1), (0, 21), (70, 13), (5, 40), (129, 3)]
    check_paged_attention(specs, dtype, head_dim, block_size, num_heads, num_kv_heads)


def check_paged_attention(
    specs: list[tuple[int, int]],
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    config: PrefillConfig | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    scale: float | None = None,
) -> None:
    """``paged_attention`` over requests of ``(cached, new)`` tokens equals the reference."""
    batch = PagedBatch([c + n for c, n in specs], block_size, num_kv_heads, head_dim, dtype)
    qsl = [0]
    for _, n in specs:
        qsl.append(qsl[-1] + n)
    query = random_heads(qsl[-1], num_heads, head_dim, dtype)
    scale = scale or head_dim**-0.5
    out = torch.full(query.shape, POISON, dtype=dtype, device=DEVICE)
    paged_attention(
        query,
        batch.cache,
        out,
        torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEVICE),
        batch.block_tables,
        scale,
        max(n for _, n in specs),
        window=window,
        softcap=softcap,
        config=config,
    )
    want = ref_paged_attention(
        query, batch.cache, qsl, batch.seq_lens, batch.block_tables, scale, window, softcap
    )
    assert_close(out, want, dtype)


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize(
    "config",
    [
        PrefillConfig(128, 32, 8, 3, True),
        PrefillConfig(64, 128, 4, 4),
        PrefillConfig(128, 64, 4, 2),
    ],
    ids=str,
)
def test_paged_attention_launches_agree(head_dim: int, config: PrefillConfig) -> None:
    """Other launches of the prompt kernel (``config``: more tile rows, other key tiles, the
    heaviest q-blocks first) give the reference's output: 7 query heads a KV head, chunks over
    context, one longer than a 128-row tile's tokens."""
    specs = [(0, 45), (70, 13), (129, 30), (0, 1)]
    check_paged_attention(specs, torch.bfloat16, head_dim, 16, 14, 2, config)


def test_paged_attention_on_a_slice_leaves_other_rows() -> None:
    """The backend passes the prefills after the decodes as a slice whose offsets start above 0;
    the decode rows must stay unwritten."""
    dtype, num_heads, num_kv_heads, head_dim = torch.float32, 7, 1, 64
    specs = [(9, 1), (30, 1), (0, 17), (20, 5)]
    batch = PagedBatch([c + n for c, n in specs], 16, num_kv_heads, head_dim, dtype)
    qsl = [0, 1, 2, 19, 24]
    query = random_heads(qsl[-1], num_heads, head_dim, dtype)
    out = torch.full(query.shape, POISON, dtype=dtype, device=DEVICE)
    paged_attention(
        query,
        batch.cache,
        out,
        torch.tensor(qsl[2:], dtype=torch.int32, device=DEVICE),
        torch.tensor(batch.seq_lens[2:], dtype=torch.int32, device=DEVICE),
        batch.block_tables[2:],
        0.125,
        17,
    )
    want = ref_paged_attention(
        query, batch.cache, qsl[2:], batch.seq_lens[2:], batch.block_tables[2:], 0.125
    )
    assert out[:2].isnan().all()
    assert_close(out[2:], want[2:], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("num_splits", "fuse_reduce"), [(1, True), (4, True), (4, False)])
def test_decode_attention_matches_reference(
    dtype: torch.dtype, head_dim: int, block_size: int, num_splits: int, fuse_reduce: bool
) -> None:
    num_heads, num_kv_heads = GQA[head_dim == 128]
    # lengths below one tile, across tile and block edges, and long enough for every split
    seq_lens = [1, 5, 64, 97, 300, 515]
    batch = PagedBatch(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=1)
    query = random_heads(len(seq_lens), num_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = torch.full(query.shape, POISON, dtype=dtype, device=DEVICE)
    decode_attention(
        query,
        batch.cache,
        out,
        torch.tensor(seq_lens, device=DEVICE),
        batch.block_tables,
        scale,
        num_splits,
        fuse_reduce=fuse_reduce,
    )
    want = ref_decode_attention(query, batch.cache, seq_lens, batch.block_tables, scale)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("fuse_reduce", [True, False])
def test_decode_reduce_over_more_slices_than_it_unrolls(fuse_reduce: bool) -> None:
    """Head size 128 cuts keys into 64-key slices: 16 splits of lengths 515 and 1000 give 9 and
    16 slices with keys, read by the reduce over two rounds of ``COMBINE_UNROLL`` (8); a short
    request beside them uses one slice."""
    from baton_kernels.triton.decode_attention import COMBINE_UNROLL

    assert COMBINE_UNROLL == 8
    seq_lens = [515, 1000, 30]
    batch = PagedBatch(seq_lens, 16, 2, 128, torch.float32, seed=5)
    query = random_heads(3, 4, 128, torch.float32)
    out = torch.full(query.shape, POISON, device=DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    decode_attention(
        query, batch.cache, out, lens, batch.block_tables, 0.1, 16, fuse_reduce=fuse_reduce
    )
    want = ref_decode_attention(query, batch.cache, seq_lens, batch.block_tables, 0.1)
    assert_close(out, want, torch.float32)


def test_fused_split_reduce_leaves_its_counters_zero() -> None:
    """The last split of each (request, KV head) combines the partials and resets its counter,
    so the next launch (a CUDA graph replays the same buffers) starts from zero again."""
    from baton_kernels.triton.common import zeroed_counters

    seq_lens = [3, 130, 515]
    batch = PagedBatch(seq_lens, 16, 2, 64, torch.float32, seed=4)
    lens = torch.tensor(seq_lens, device=DEVICE)
    for _ in range(2):
        query = random_heads(3, 8, 64, torch.float32)
        out = torch.full(query.shape, POISON, device=DEVICE)
        decode_attention(query, batch.cache, out, lens, batch.block_tables, 0.125, 8)
        assert int(zeroed_counters(DEVICE, 6, "decode_attention")[:6].count_nonzero()) == 0
        want = ref_decode_attention(query, batch.cache, seq_lens, batch.block_tables, 0.125)
        assert_close(out, want, torch.float32)


def test_decode_matches_paged_attention_reference() -> None:
    """The two references agree on decodes, so the kernels are checked against one truth."""
    batch = PagedBatch([3, 40, 77], 16, 2, 64, torch.float32)
    query = random_heads(3, 8, 64, torch.float32)
    a = ref_decode_attention(query, batch.cache, batch.seq_lens, batch.block_tables, 0.1)
    b = ref_paged_attention(
        query, batch.cache, [0, 1, 2, 3], batch.seq_lens, batch.block_tables, 0.1
    )
    torch.testing.assert_close(a, b)


def test_choose_num_splits() -> None:
    cpu = torch.device("cpu")  # counts as 4 SMs
    assert choose_num_splits(64, 8, 8192, cpu) == 1  # programs cover the SMs twice already
    assert choose_num_splits(4, 1, 8192, cpu) == 4  # 4 programs per SM
    assert choose_num_splits(1, 1, 8192, cpu) == 16
    assert choose_num_splits(1, 1, 150, cpu) == 2  # no slice under MIN_SPLIT_TOKENS (64)
    assert choose_num_splits(1, 1, 60, cpu) == 1
    assert choose_num_splits(3, 1, 8192, cpu) == 4  # 6, rounded down to a power of two


def test_decode_launch_narrows_wide_heads_only_with_many_requests() -> None:
    """Heads of 128 with one split a request take one warp and 32-key tiles once there are
    ``WIDE_HEAD_PROGRAMS_PER_SM`` programs an SM (8 x 4 on a CPU); fewer programs, split
    launches and heads of 64 keep the two-warp (four-warp) launches."""
    cpu = torch.device("cpu")
    assert decode_launch(128, 16, 2, 1, cpu) == (32, 1, 3)  # 32 programs
    assert decode_launch(128, 15, 2, 1, cpu) == (64, 2, 2)
    assert decode_launch(128, 64, 2, 4, cpu) == (64, 2, 3)
    assert decode_launch(64, 64, 2, 1, cpu) == (128, 4, 2)
    assert set(decode_launches(128, 1)) == {(32, 1, 3), (64, 2, 2)}  # both warmed up


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_of_many_requests_with_wide_heads_matches_reference(
    dtype: torch.dtype,
) -> None:
    """The one-warp, 32-key-tile launch (many requests, head 128, one split) against the
    reference: lengths across tile and block edges."""
    num_heads, num_kv_heads = GQA[1]
    seq_lens = [1 + (37 * i) % 150 for i in range(20)]  # 40 programs: the CPU's choice too
    launch = decode_launches(128, 1)[1]
    assert launch[1] == 1
    assert decode_launch(128, len(seq_lens), num_kv_heads, 1, torch.device("cpu")) == launch
    batch = PagedBatch(seq_lens, 16, num_kv_heads, 128, dtype, seed=3)
    query = random_heads(len(seq_lens), num_heads, 128, dtype)
    out = torch.full(query.shape, POISON, dtype=dtype, device=DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    decode_attention(query, batch.cache, out, lens, batch.block_tables, 128**-0.5, 1,
                     tile_n=launch[0], num_warps=launch[1], num_stages=launch[2])  # fmt: skip
    want = ref_decode_attention(query, batch.cache, seq_lens, batch.block_tables, 128**-0.5)
    assert_close(out, want, dtype)


# --- Sliding windows and softcaps ---------------------------------------------------------------
# (dtype, block size, query heads, KV heads): each pair of float32 / bfloat16, blocks of 16 / 32
# and groups of 7 (Qwen2.5-0.5B) / 1 (no GQA) once, to keep the interpreter's time down. A
# softcap of 2 bends the scores of these random inputs (about N(0, 1) after the scale) hard, so
# a kernel that skipped it would be far off.
WINDOW_CASES = [
    (torch.float32, 16, 7, 1),
    (torch.bfloat16, 32, 7, 1),
    (torch.float32, 32, 2, 2),
    (torch.bfloat16, 16, 2, 2),
]
WINDOW_CASE_IDS = ["fp32-16-g7", "bf16-32-g7", "fp32-32-g1", "bf16-16-g1"]
SOFTCAP = 2.0


@triton.jit
def _softcapped_kernel(x_ptr, out_ptr, ratio, cap, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, softcapped(tl.load(x_ptr + offs), ratio, cap))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("cap", [1.0, 50.0])
def test_softcapped_matches_tanh(cap: float) -> None:
    """The kernels' tanh from exp2 against torch's, from tiny to huge arguments and infinities
    (exp2 overflows to inf or underflows to 0: +-cap, never NaN)."""
    small = torch.logspace(-8, 0, 100)
    x = torch.cat(
        [
            torch.linspace(-40, 40, 301),
            small,
            -small,
            torch.tensor([0.0, 1e4, -1e4, 1e30, -1e30, 3e38, -3e38, math.inf, -math.inf]),
        ]
    )
    x = torch.cat([x, torch.zeros(1024 - x.numel())]).to(DEVICE)  # tl.arange: a power of two
    out = torch.full_like(x, POISON)
    _softcapped_kernel[(1,)](x, out, 1.0 / cap, cap, N=x.numel())
    want = cap * torch.tanh(x.double() / cap)
    assert not out.isnan().any()
    # (under the interpreter at most 1.9e-7 of the cap; compiled, exp2 and / are approximate)
    torch.testing.assert_close(out.double(), want, atol=1e-6 * cap, rtol=0)


def check_decode_attention(
    seq_lens: list[int],
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_splits: int,
    *,
    window: int = 0,
    softcap: float = 0.0,
    fuse_reduce: bool | None = None,
    tile_n: int | None = None,
    scale: float | None = None,
    seed: int = 1,
) -> None:
    """``decode_attention`` over requests of ``seq_lens`` keys equals the reference."""
    batch = PagedBatch(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=seed)
    query = random_heads(len(seq_lens), num_heads, head_dim, dtype)
    scale = scale or head_dim**-0.5
    out = torch.full(query.shape, POISON, dtype=dtype, device=DEVICE)
    decode_attention(
        query,
        batch.cache,
        out,
        torch.tensor(seq_lens, device=DEVICE),
        batch.block_tables,
        scale,
        num_splits,
        window=window,
        softcap=softcap,
        fuse_reduce=fuse_reduce,
        tile_n=tile_n,
    )
    want = ref_decode_attention(
        query, batch.cache, seq_lens, batch.block_tables, scale, window, softcap
    )
    assert_close(out, want, dtype)


@pytest.mark.parametrize(
    ("dtype", "block_size", "num_heads", "num_kv_heads"), WINDOW_CASES, ids=WINDOW_CASE_IDS
)
@pytest.mark.parametrize(("num_splits", "fuse_reduce"), [(1, True), (4, True), (4, False)])
@pytest.mark.parametrize(
    ("window", "softcap"), [(100, 0.0), (300, 0.0), (0, SOFTCAP), (300, SOFTCAP)]
)
def test_decode_attention_with_window_and_softcap_matches_reference(
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_splits: int,
    fuse_reduce: bool,
    window: int,
    softcap: float,
) -> None:
    """Requests shorter than the window, as long and longer (head 64: 128-key tiles). The
    window of 300 keys over 4 splits fills 3 of them (128 keys each), starting mid-block (515
    and 301 keys: at 215 and 1) or on a block edge (700 keys: at 400); that of 100 keys fills
    one, the only one the reduce reads."""
    seq_lens = [1, 50, 100, 299, 300, 301, 515, 700]
    check_decode_attention(
        seq_lens, dtype, 64, block_size, num_heads, num_kv_heads, num_splits,
        window=window, softcap=softcap, fuse_reduce=fuse_reduce,
    )  # fmt: skip


@pytest.mark.parametrize("fuse_reduce", [True, False])
@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
def test_decode_window_over_more_slices_than_the_reduce_unrolls(
    fuse_reduce: bool, softcap: float
) -> None:
    """16-key tiles cut a window of 203 keys into 13 slices (two rounds of the reduce's 8),
    each starting mid-block (at 312 of 515 keys, 797 of 1000); requests shorter than the
    window, as long and one key longer beside them."""
    seq_lens = [515, 1000, 30, 203, 204]
    check_decode_attention(
        seq_lens, torch.float32, 128, 16, 4, 2, 16,
        window=203, softcap=softcap, fuse_reduce=fuse_reduce, tile_n=16, seed=5,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_softcap_of_huge_scores_is_finite() -> None:
    """Scores far beyond the cap (a scale of 1000) saturate at +-cap in both kernels."""
    check_decode_attention(
        [3, 70, 300], torch.float32, 64, 16, 7, 1, 4, softcap=5.0, window=100, scale=1000.0
    )
    specs = [(0, 20), (70, 13)]
    check_paged_attention(specs, torch.float32, 64, 16, 7, 1, softcap=5.0, window=30, scale=1000.0)


@pytest.mark.parametrize(
    ("dtype", "block_size", "num_heads", "num_kv_heads"), WINDOW_CASES, ids=WINDOW_CASE_IDS
)
@pytest.mark.parametrize(
    ("window", "softcap"), [(20, 0.0), (100, 0.0), (0, SOFTCAP), (50, SOFTCAP)]
)
def test_paged_attention_with_window_and_softcap_matches_reference(
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    window: int,
    softcap: float,
) -> None:
    """Decodes, fresh chunks and chunks after cached context (head 64: 64-key tiles), the
    windows cutting through tiles: the first tiles skipped (200 + 3 under 20 or 50), masked
    before the tiles every row sees whole and the diagonal's after them (129 + 30 under 100:
    [0, 64) masked, [64, 128) whole, [128, 159) masked), rows of one program whose windows
    start tiles apart (0 + 45, 5 + 40)."""
    specs = [(0, 1), (37, 1), (0, 45), (70, 13), (5, 40), (129, 30), (200, 3)]
    check_paged_attention(
        specs, dtype, 64, block_size, num_heads, num_kv_heads, window=window, softcap=softcap
    )


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize(
    "config",
    [
        PrefillConfig(128, 32, 8, 3, True),
        PrefillConfig(64, 128, 4, 4),
        PrefillConfig(16, 64, 4, 2),
    ],
    ids=str,
)
def test_paged_attention_window_launches_agree(head_dim: int, config: PrefillConfig) -> None:
    """Other tile shapes under a window of 40 and a softcap: 32-, 128- and 64-key tiles, 128,
    64 and 16 rows (18, 9 and 2 tokens of 7 heads)."""
    specs = [(0, 45), (70, 13), (129, 30), (0, 1), (300, 20)]
    check_paged_attention(
        specs, torch.bfloat16, head_dim, 16, 14, 2, config, window=40, softcap=SOFTCAP
    )


def test_window_and_softcap_must_not_be_negative() -> None:
    batch = PagedBatch([5], 16, 1, 64, torch.float32)
    query = random_heads(1, 7, 64, torch.float32)
    lens = torch.tensor([5], device=DEVICE)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    out, tables = torch.empty_like(query), batch.block_tables
    for bad in ({"window": -1}, {"softcap": -1.0}):
        with pytest.raises(ValueError, match="must be >= 0"):
            decode_attention(query, batch.cache, out, lens, tables, 1.0, 1, **bad)
        with pytest.raises(ValueError, match="must be >= 0"):
            paged_attention(query, batch.cache, out, cu, lens.int(), tables, 1.0, 1, **bad)


def make_step(
    specs: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
) -> tuple[AttentionMetadata, PagedBatch]:
    """A step over requests of (cached, new) tokens; the batch's cache (of ``kv_dtype``,
    default ``dtype``) holds every token's K/V, new ones included, as it should after the
    step."""
    batch = PagedBatch(
        [c + n for c, n in specs], block_size, num_kv_heads, head_dim, dtype, kv_dtype=kv_dtype
    )
    slot_block, slot_offset, qsl = [], [], [0]
    for i, (cached, new) in enumerate(specs):
        for pos in range(cached, cached + new):
            slot_block.append(int(batch.block_tables[i, pos // block_size]))
            slot_offset.append(pos % block_size)
        qsl.append(qsl[-1] + new)
    num_decodes = sum(1 for _, n in specs if n == 1)
    decode_blocks = [-(s // -block_size) for s in batch.seq_lens[:num_decodes]]
    md = AttentionMetadata(
        num_reqs=len(specs),
        num_decodes=num_decodes,
        num_tokens=qsl[-1],
        query_start_loc=qsl,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        slot_block=torch.tensor(slot_block, device=DEVICE),
        slot_offset=torch.tensor(slot_offset, device=DEVICE),
        decode_bias=None,
        max_decode_blocks=max(decode_blocks, default=0),
    )
    return md, batch


# (window, softcap) of a layer through the backend: off, and a window of 20 (cutting a decode's
# keys mid-block and the last chunk's rows' at different tiles) with a softcap
BACKEND_OPTIONS = [(0, 0.0), (20, SOFTCAP)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), BACKEND_OPTIONS)
def test_triton_backend_matches_reference(dtype: torch.dtype, window: int, softcap: float) -> None:
    specs = [(4, 1), (300, 1), (0, 12), (33, 9)]
    md, want = make_step(specs, 16, 1, 64, dtype)
    slots = (md.slot_block, slice(None), md.slot_offset)
    new_k, new_v = want.cache.kv[slots].unbind(1)
    # the cache before the step: the new tokens' slots hold stale data
    pool = want.pool.clone()
    cache = KVCacheView(pool[:, 1])
    cache.kv[slots] = torch.randn(cache.kv[slots].shape, device=DEVICE).to(dtype)
    query = random_heads(md.num_tokens, 7, 64, dtype)
    out = TritonAttentionBackend().forward(
        query, new_k, new_v, cache, md, 0.125, window=window, softcap=softcap
    )
    torch.testing.assert_close(pool, want.pool, atol=0, rtol=0)
    ref = ref_paged_attention(
        query, want.cache, md.query_start_loc, md.seq_lens, md.block_tables, 0.125, window, softcap
    )
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), BACKEND_OPTIONS)
def test_triton_backend_forward_rope_matches_rotary_then_forward(
    dtype: torch.dtype, window: int, softcap: float
) -> None:
    """The model's path with fused kernels: q and k rotated by position in place, the rotated
    K and V written into the cache by the same launch, then attention as ``forward``."""
    from baton_engine.models.rotary import RotaryEmbedding

    specs = [(4, 1), (300, 1), (0, 12), (33, 9)]
    md, want = make_step(specs, 16, 1, 64, dtype)
    slots = (md.slot_block, slice(None), md.slot_offset)
    new_k, new_v = (t.clone() for t in want.cache.kv[slots].unbind(1))
    query = random_heads(md.num_tokens, 7, 64, dtype)
    positions = torch.tensor([c + i for c, n in specs for i in range(n)], device=DEVICE)
    cos_sin = RotaryEmbedding(64, 512, 10000.0, None).to(DEVICE).cos_sin
    want_q, want_k = ref_rotary_embedding(query.clone(), new_k.clone(), positions, cos_sin)
    want.cache.kv[md.slot_block, 0, md.slot_offset] = want_k  # the cache holds rotated keys
    pool = want.pool.clone()
    cache = KVCacheView(pool[:, 1])
    cache.kv[slots] = torch.randn(cache.kv[slots].shape, device=DEVICE).to(dtype)  # stale
    out = TritonAttentionBackend().forward_rope(
        query, new_k, new_v, cache, md, 0.125, positions, cos_sin, window=window, softcap=softcap
    )
    assert_close(query, want_q, dtype)
    assert_close(pool, want.pool, dtype)
    ref = ref_paged_attention(
        want_q, want.cache, md.query_start_loc, md.seq_lens, md.block_tables, 0.125, window,
        softcap,
    )  # fmt: skip
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_attention_rotates_and_writes_the_new_token_itself(
    dtype: torch.dtype, head_dim: int, num_splits: int
) -> None:
    """``rope``: the decode kernel rotates q and writes the rotated K and the V of each
    request's new token before reading its keys. Out and cache equal the rotary kernel's
    write followed by plain decode attention, within rounding; ``query`` and ``key`` are left
    unrotated; a padding row (slot -1) writes nothing. Lengths put the new token alone (no
    cached key), in the first, a middle and the last slice, and alone in its slice (257 keys:
    with 4 splits of one 128-key tile, the third slice)."""
    num_heads, num_kv_heads = GQA[head_dim == 128]
    specs = [(3, 1), (64, 1), (200, 1), (514, 1), (0, 1), (256, 1)]
    check_decode_rope(specs, num_heads, num_kv_heads, head_dim, dtype, num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
def test_decode_rope_under_a_window_writes_the_new_token_before_reading_it(
    dtype: torch.dtype, num_splits: int, softcap: float
) -> None:
    """``rope`` with a window of 150 (head 128: 64-key tiles, so 4 splits fill 3 slices of the
    window): the program of the window's last slice writes the new token's K/V before the reads
    (with 1,000 keys the unwindowed split would fill 4). Out equals the reference over the
    cache the rotary kernel writes; requests shorter than the window, as long, and longer
    (515 keys: the window starts mid-block); a padding row writes nothing."""
    specs = [(3, 1), (149, 1), (149, 1), (514, 1), (0, 1), (999, 1)]
    check_decode_rope(specs, 8, 2, 128, dtype, num_splits, window=150, softcap=softcap)


def check_decode_rope(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """``decode_attention`` with ``rope`` against the rotary kernel's write followed by the
    reference's attention (row 1 a padding row: slot -1, its slot keeps what it held); ``query``
    and ``key`` are left unrotated."""
    from baton_engine.models.rotary import RotaryEmbedding
    from baton_kernels.triton.decode_attention import DecodeRope
    from baton_kernels.triton.fused_ops import rotary_embedding_and_write_kv_

    md, batch = make_step(specs, 16, num_kv_heads, head_dim, dtype)
    slot_block = md.slot_block.clone()
    slot_block[1] = -1
    slots = (md.slot_block, slice(None), md.slot_offset)
    batch.cache.kv[slots] = torch.randn(batch.cache.kv[slots].shape, device=DEVICE).to(dtype)
    n = len(specs)
    query = random_heads(n, num_heads, head_dim, dtype)
    key = random_heads(n, num_kv_heads, head_dim, dtype)
    value = random_heads(n, num_kv_heads, head_dim, dtype)
    positions = torch.tensor([c for c, _ in specs], device=DEVICE)
    cos_sin = RotaryEmbedding(head_dim, 1024, 10000.0, None).to(DEVICE).cos_sin
    want_pool = batch.pool.clone()
    want_cache = KVCacheView(want_pool[:, 1])
    want_q, want_k = query.clone(), key.clone()
    rotary_embedding_and_write_kv_(
        want_q, want_k, value, positions, cos_sin, want_cache.kv, slot_block, md.slot_offset
    )
    want = ref_decode_attention(
        want_q, want_cache, md.seq_lens, md.block_tables, 0.1, window, softcap
    )
    unrotated = query.clone(), key.clone()
    out = torch.full(query.shape, POISON, dtype=dtype, device=DEVICE)
    rope = DecodeRope(positions, cos_sin, key, value, slot_block, md.slot_offset)
    lens = torch.tensor(md.seq_lens, device=DEVICE)
    decode_attention(query, batch.cache, out, lens, md.block_tables, 0.1, num_splits,
                     window=window, softcap=softcap, rope=rope)  # fmt: skip
    # (compiled, the two kernels' rotations may round differently: contracted multiply-adds)
    assert_close(batch.pool, want_pool, dtype)
    assert_close(out, want, dtype)
    assert torch.equal(query, unrotated[0]) and torch.equal(key, unrotated[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_attention_applies_a_folded_norm(
    dtype: torch.dtype, bias: bool, num_splits: int
) -> None:
    """``rope.norm`` (a layer whose input RMSNorm is folded into its qkv projection): the
    kernel multiplies q, k and v by each request's 1/rms of its stream row and adds the bias,
    rounded to the dtype as a projection's output, before rotating and writing. Out and cache
    equal the same launch on q/k/v normed beforehand (a hidden size of 96: not a power of
    two), within rounding; a padding row writes nothing."""
    from baton_engine.models.rotary import RotaryEmbedding
    from baton_kernels.triton.decode_attention import DecodeNorm, DecodeRope

    num_heads, num_kv_heads, head_dim, hidden = 7, 1, 64, 96
    specs = [(3, 1), (64, 1), (514, 1), (0, 1), (200, 1)]
    md, batch = make_step(specs, 16, num_kv_heads, head_dim, dtype)
    slot_block = md.slot_block.clone()
    slot_block[1] = -1
    n = len(specs)
    stream = (torch.randn(n, hidden, device=DEVICE) * torch.rand(n, 1, device=DEVICE) * 4).to(dtype)
    width = num_heads + 2 * num_kv_heads
    raw = torch.randn(n, width, head_dim, device=DEVICE).to(dtype)
    qkv_bias = torch.randn(width, head_dim, device=DEVICE).to(dtype) if bias else None
    rstd = torch.rsqrt(stream.float().pow(2).mean(-1) + 1e-6)[:, None, None]
    normed = (raw.float() * rstd + (qkv_bias.float() if bias else 0.0)).to(dtype)
    positions = torch.tensor([c for c, _ in specs], device=DEVICE)
    cos_sin = RotaryEmbedding(head_dim, 1024, 10000.0, None).to(DEVICE).cos_sin
    lens = torch.tensor(md.seq_lens, device=DEVICE)
    outs, pools = [], []
    for qkv, norm in ((normed, None), (raw, DecodeNorm(stream, 1e-6, qkv_bias))):
        pool = batch.pool.clone()
        cache = KVCacheView(pool[:, 1])
        q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        rope = DecodeRope(positions, cos_sin, k, v, slot_block, md.slot_offset, norm)
        out = torch.full(q.shape, POISON, dtype=dtype, device=DEVICE)
        decode_attention(q, cache, out, lens, md.block_tables, 0.1, num_splits, rope=rope)
        outs.append(out)
        pools.append(pool)
    assert_close(pools[1], pools[0], dtype)
    assert_close(outs[1], outs[0], dtype)
    unchanged = (md.slot_block[1:2], slice(None), md.slot_offset[1:2])
    assert torch.equal(pools[1][:, 1][unchanged], batch.pool[:, 1][unchanged])


def test_decode_attention_rejects_a_mismatched_rope() -> None:
    """A ``rope`` (or its folded ``norm``) whose tensors do not fit the batch is a clear
    error."""
    from baton_kernels.triton.decode_attention import DecodeNorm, DecodeRope

    batch = PagedBatch([5, 9], 16, 2, 64, torch.float32)
    query = random_heads(2, 8, 64, torch.float32)
    out = torch.empty_like(query)
    lens = torch.tensor([5, 9], device=DEVICE)
    two = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    key = random_heads(2, 2, 64, torch.float32)
    cos_sin = torch.ones(16, 2, 64, device=DEVICE)
    bad = {
        "key": DecodeRope(two, cos_sin, key[:, :1], key, two, two),
        "value": DecodeRope(two, cos_sin, key, key.to(torch.bfloat16), two, two),
        "positions": DecodeRope(two[:1], cos_sin, key, key, two, two),
        "cos_sin": DecodeRope(two, cos_sin[:, :, :32], key, key, two, two),
    }
    stream = torch.randn(2, 32, device=DEVICE)
    bad_norms = {
        "stream must be \\[2, hidden\\]": DecodeNorm(stream[:1], 1e-6, None),
        "stream must be \\[2, hidden\\], its rows dense": DecodeNorm(
            stream.t().contiguous().t(), 1e-6, None
        ),
        "stream must be torch.float32": DecodeNorm(stream.double(), 1e-6, None),
        "bias must be": DecodeNorm(stream, 1e-6, torch.zeros(12, 32, device=DEVICE)),
    }
    for match, norm in bad_norms.items():
        bad[f"norm.{match}"] = DecodeRope(two, cos_sin, key, key, two, two, norm)
    for name, rope in bad.items():
        with pytest.raises(ValueError, match=name if "norm" in name else f"rope.{name}"):
            decode_attention(query, batch.cache, out, lens, batch.block_tables, 0.1, 1, rope=rope)


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (100, SOFTCAP)])
def test_forward_rope_of_a_decode_only_step_runs_one_launch(
    monkeypatch: pytest.MonkeyPatch, window: int, softcap: float
) -> None:
    """The backend's decode-only ``forward_rope`` hands the rotation to the decode kernel (the
    rotary kernel would have rotated ``query`` in place) and matches the mixed-step path's
    result for the same rows, and the reference over what that path rotated and wrote (a
    window of 100 cuts the 300 keys mid-block, over two splits)."""
    from baton_engine.models.rotary import RotaryEmbedding
    from baton_kernels.attention import triton_backend

    specs = [(4, 1), (300, 1), (63, 1)]
    outs, queries = [], []
    for fused in (True, False):
        md, batch = make_step(specs, 16, 2, 64, torch.bfloat16)
        slots = (md.slot_block, slice(None), md.slot_offset)
        new_k, new_v = (t.clone() for t in batch.cache.kv[slots].unbind(1))
        query = random_heads(3, 8, 64, torch.bfloat16)
        positions = torch.tensor([c for c, _ in specs], device=DEVICE)
        cos_sin = RotaryEmbedding(64, 512, 10000.0, None).to(DEVICE).cos_sin
        before = query.clone()
        monkeypatch.setattr(triton_backend, "FUSE_DECODE_ROPE", fused)
        options = {"window": window, "softcap": softcap}
        backend = TritonAttentionBackend()
        outs.append(
            backend.forward_rope(
                query, new_k, new_v, batch.cache, md, 0.125, positions, cos_sin, **options
            )
        )
        queries.append(torch.equal(query, before))
    assert queries == [True, False]
    assert_close(outs[0], outs[1], torch.bfloat16)
    # the unfused path rotated query in place and wrote the rotated keys: the reference's inputs
    ref = ref_decode_attention(
        query, batch.cache, md.seq_lens, md.block_tables, 0.125, window, softcap
    )
    assert_close(outs[0], ref, torch.bfloat16)


@pytest.fixture
def no_backend_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.delenv("BATON_ATTENTION_BACKEND", raising=False)
    yield monkeypatch


def test_registry_lists_every_backend() -> None:
    assert {"torch", "cpu", "triton", "flash_attn", "flashinfer"} <= set(available_backends())


def test_unknown_backend_lists_valid_names(no_backend_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'.*'triton'"):
        create_attention_backend("nope")
    no_backend_env.setenv("BATON_ATTENTION_BACKEND", "nope")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        create_attention_backend("auto")


def test_env_var_replaces_auto_but_not_an_explicit_name(
    no_backend_env: pytest.MonkeyPatch,
) -> None:
    no_backend_env.setenv("BATON_ATTENTION_BACKEND", "torch")
    assert create_attention_backend("auto", "cpu").name == "torch"
    no_backend_env.setenv("BATON_ATTENTION_BACKEND", "nope")
    assert create_attention_backend("torch", "cpu").name == "torch"


def test_missing_optional_package_is_a_clear_error(no_backend_env: pytest.MonkeyPatch) -> None:
    for name in ("flash_attn", "flashinfer"):
        try:
            __import__(name)
        except ImportError:
            with pytest.raises(ValueError, match=f"'{name}' package does not import"):
                create_attention_backend(name, "cuda", dtype=torch.bfloat16, head_dim=128)


def test_backend_checks_dtype_head_size_and_device(no_backend_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"does not support torch\.float32"):
        create_attention_backend("flashinfer", "cuda", dtype=torch.float32)
    with pytest.raises(ValueError, match="head sizes"):
        create_attention_backend("flashinfer", "cuda", head_dim=80)
    with pytest.raises(ValueError, match="runs on cpu, not cuda"):
        create_attention_backend("cpu", "cuda")
    no_backend_env.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on cuda, not cpu"):
        create_attention_backend("triton", "cpu")


def test_auto_picks_by_platform(no_backend_env: pytest.MonkeyPatch) -> None:
    assert create_attention_backend("auto", "cpu").name in ("cpu", "torch")
    want = "triton" if torch.cuda.is_available() else "torch"
    assert create_attention_backend("auto", "cuda", dtype=torch.bfloat16, head_dim=64).name == want


def test_triton_backend_decode_only_step_with_device_lengths() -> None:
    """The CUDA-graph path: decodes only, lengths already on the device."""
    specs = [(4, 1), (130, 1), (63, 1)]
    md, want = make_step(specs, 16, 2, 64, torch.bfloat16)
    md = dataclasses.replace(
        md, decode_seq_lens=torch.tensor(md.seq_lens, device=DEVICE), seq_lens=[0, 0, 0]
    )  # the host lengths must not be read
    slots = (md.slot_block, slice(None), md.slot_offset)
    new_k, new_v = want.cache.kv[slots].unbind(1)
    query = random_heads(md.num_tokens, 8, 64, torch.bfloat16)
    out = TritonAttentionBackend().forward(query, new_k, new_v, want.cache, md, 0.125)
    lens = [c + n for c, n in specs]
    ref = ref_decode_attention(query, want.cache, lens, md.block_tables, 0.125)
    assert_close(out, ref, torch.bfloat16)


def test_warmup_runs_every_variant_and_leaves_the_cache_alone() -> None:
    """The engine compiles the backend's kernels at startup: every decode split count, the
    prefill kernel and the cache write run, and the cache the model will use is untouched."""
    pool = torch.randn(4, NUM_LAYERS, 2, 16, 2, 64, device=DEVICE)
    before = pool.clone()
    TritonAttentionBackend().warmup(KVCacheView(pool[:, 1]), num_heads=14)
    assert torch.equal(pool, before)
    assert split_counts() == [1, 2, 4, 8, 16, 32, 64]
    assert all(choose_num_splits(n, 2, 4096, DEVICE) in split_counts() for n in (1, 3, 40, 999))
    # at most so many keys: the counts that many can take, and no other
    assert split_counts(1024) == [1, 2, 4, 8, 16] and split_counts(100) == [1, 2]
    for keys in (1, 64, 65, 100, 640, 1024, 1500, 8192):
        taken = {choose_num_splits(n, h, k, DEVICE) for n in range(1, 40) for h in (1, 2, 8)
                 for k in range(1, keys + 1, 7)}  # fmt: skip
        assert taken <= set(split_counts(keys)), keys


def test_warmup_compiles_the_split_counts_its_lengths_can_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``warmup`` for decodes of at most ``max_seq_len`` keys, or a layer's window (the keys
    it splits) launches the split counts those can take, not all of them."""
    from baton_kernels.attention import triton_backend

    splits: set[int] = set()

    def spy(*args: Any, **kwargs: Any) -> None:
        splits.add(args[6])
        decode_attention(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention", spy)
    pool = torch.randn(4, NUM_LAYERS, 2, 16, 2, 64, device=DEVICE)
    backend = TritonAttentionBackend()
    seen = []
    for window, max_seq_len in ((0, None), (0, 1024), (100, 1024), (4096, 1024), (100, None)):
        splits.clear()
        backend.warmup(KVCacheView(pool[:, 1]), 14, window=window, max_seq_len=max_seq_len)
        seen.append(sorted(splits))
    assert seen == [split_counts(), [1, 2, 4, 8, 16], [1, 2], [1, 2, 4, 8, 16], [1, 2]]


def test_backend_splits_a_windowed_decode_over_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window shorter than the decodes' keys: the split count is chosen for the keys read
    (``choose_num_splits`` of the window), not for ``max_decode_blocks``."""
    from baton_kernels.attention import triton_backend

    splits = []

    def spy(*args: Any, **kwargs: Any) -> None:
        splits.append(args[6])
        decode_attention(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention", spy)
    md, batch = make_step([(2000, 1)], 16, 1, 64, torch.float32)
    slots = (md.slot_block, slice(None), md.slot_offset)
    new_k, new_v = batch.cache.kv[slots].unbind(1)
    query = random_heads(1, 7, 64, torch.float32)
    backend = TritonAttentionBackend()
    for window in (0, 100, 5000):
        out = backend.forward(query, new_k, new_v, batch.cache, md, 0.125, window=window)
        ref = ref_decode_attention(query, batch.cache, md.seq_lens, md.block_tables, 0.125, window)
        assert_close(out, ref, torch.float32)
    assert splits == [16, 2, 16]  # 2,016 keys, 100, 2,016 (4 SMs on a CPU: 16 at most)


@pytest.mark.parametrize(("window", "softcap"), [(4096, 50.0), (512, 0.0)])
def test_warmup_launches_the_variants_of_a_window_and_softcap(
    monkeypatch: pytest.MonkeyPatch, window: int, softcap: float
) -> None:
    """``warmup`` with a layer's options launches (compiles, on a GPU) the kernels' variants
    for them, and leaves the cache alone."""
    from baton_kernels.triton import decode_attention as decode_module
    from baton_kernels.triton import paged_attention as prefill_module

    seen = set()
    for module in (decode_module, prefill_module):

        def spy(kernel: Any, real: Any = module.launcher) -> Any:
            def launch(grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
                seen.add((kernel.__name__, kwargs["WINDOWED"], kwargs["SOFTCAP"]))
                real(kernel)(grid, *args, **kwargs)

            return launch

        monkeypatch.setattr(module, "launcher", spy)
    pool = torch.randn(4, NUM_LAYERS, 2, 16, 2, 64, device=DEVICE)
    before = pool.clone()
    TritonAttentionBackend().warmup(
        KVCacheView(pool[:, 1]), num_heads=14, window=window, softcap=softcap
    )
    assert torch.equal(pool, before)
    flags = (window > 0, softcap > 0)
    assert seen == {("_decode_kernel", *flags), ("_paged_attention_kernel", *flags)}


# --- 8-bit caches (--kv-cache-dtype fp8 / fp8_e5m2) ---------------------------------------------


# (power-of-two scales: K and V divided by them exactly, so the writes equal torch's bit for bit)
SCALES = [(1.0, 1.0), (4.0, 0.5)]


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), BACKEND_OPTIONS)
@pytest.mark.parametrize("scales", SCALES)
def test_triton_backend_with_an_8bit_cache_matches_the_reference_backend(
    kv_dtype: torch.dtype,
    dtype: torch.dtype,
    window: int,
    softcap: float,
    scales: tuple[float, float],
) -> None:
    """A mixed step (decodes, a fresh prompt, a chunk after cached context) over an 8-bit cache:
    the Triton backend stores the new K/V divided by the layer's scales and rounded as the
    reference backend does (``to_cache_dtype``, bit for bit), and every query attends to the
    K/V as the cache holds them, times the scales."""
    specs = [(4, 1), (300, 1), (0, 12), (33, 9)]
    md, batch = make_step(specs, 16, 1, 64, dtype, kv_dtype)
    cache = KVCacheView(batch.cache.kv, *scales)
    new_k = random_heads(md.num_tokens, 1, 64, dtype)
    new_v = random_heads(md.num_tokens, 1, 64, dtype)
    query = random_heads(md.num_tokens, 7, 64, dtype)
    want_pool = batch.pool.clone()
    want_cache = KVCacheView(want_pool[:, 1], *scales)
    ref_write_kv_cache(new_k, new_v, want_cache, md.slot_block, md.slot_offset)
    out = TritonAttentionBackend().forward(
        query, new_k, new_v, cache, md, 0.125, window=window, softcap=softcap
    )
    assert torch.equal(batch.pool.view(torch.uint8), want_pool.view(torch.uint8))
    want = ref_paged_attention(
        query, want_cache, md.query_start_loc, md.seq_lens, md.block_tables, 0.125, window, softcap
    )
    assert_close(out, want, dtype)


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("scales", SCALES)
def test_forward_rope_into_an_8bit_cache(
    kv_dtype: torch.dtype, dtype: torch.dtype, decode_only: bool, scales: tuple[float, float]
) -> None:
    """``forward_rope`` over an 8-bit cache: the rotary kernel's write (a mixed step) and the
    decode kernel's own (a decode-only step) store the rotated K and the V divided by the
    layer's scales and rounded, as the reference backend does after the rotation, and the
    attention reads them back times the scales."""
    from baton_engine.models.rotary import RotaryEmbedding

    specs = [(4, 1), (300, 1), (0, 1), (130, 1)] if decode_only else [(4, 1), (0, 12), (33, 9)]
    md, batch = make_step(specs, 16, 2, 64, dtype, kv_dtype)
    query = random_heads(md.num_tokens, 8, 64, dtype)
    new_k = random_heads(md.num_tokens, 2, 64, dtype)
    new_v = random_heads(md.num_tokens, 2, 64, dtype)
    positions = torch.tensor([c + i for c, n in specs for i in range(n)], device=DEVICE)
    cos_sin = RotaryEmbedding(64, 512, 10000.0, None).to(DEVICE).cos_sin
    want_q, want_k = ref_rotary_embedding(query.clone(), new_k.clone(), positions, cos_sin)
    cache = KVCacheView(batch.cache.kv, *scales)
    want_pool = batch.pool.clone()
    want_cache = KVCacheView(want_pool[:, 1], *scales)
    ref_write_kv_cache(want_k, new_v, want_cache, md.slot_block, md.slot_offset)
    out = TritonAttentionBackend().forward_rope(
        query, new_k, new_v, cache, md, 0.125, positions, cos_sin
    )
    # (the kernels' rotation rounds once, the reference's rounds its products to the dtype:
    # K a few of the dtype's steps apart, so its 8-bit value a step apart, up to 1/4 of it
    # with e5m2's 2 mantissa bits)
    atol = TOL[dtype][0] + 1e-3
    for got, want_kv, scale in ((cache.key, want_cache.key, scales[0]),
                                (cache.value, want_cache.value, scales[1])):  # fmt: skip
        torch.testing.assert_close(
            got.float() * scale, want_kv.float() * scale, atol=atol, rtol=0.26
        )
    assert torch.equal(batch.pool[:, [0, 2]], want_pool[:, [0, 2]])  # other layers untouched
    want = ref_paged_attention(
        want_q, cache, md.query_start_loc, md.seq_lens, md.block_tables, 0.125
    )
    assert_close(out, want, dtype)
