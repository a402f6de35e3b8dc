"""The Triton backend: three launches per layer at most.

    write_kv_cache      all new tokens' K/V into the paged cache (or, through ``forward_rope``,
                        the rotary kernel rotating q and k writes them: one launch fewer; on a
                        decode-only step the decode kernel rotates and writes itself)
    decode_attention    the first ``num_decodes`` requests (flash-decoding, split over the keys)
    paged_attention     the remaining prefill chunks, causal over cached + new tokens

The step's small device tensors (query offsets, lengths) are built once per ``AttentionMetadata``
object and reused by every layer of that step.

A layer's sliding ``window`` and ``softcap`` go to both attention kernels, which compile a variant
per combination of the two switched on (not per value); ``warmup`` compiles those of the options
it is given.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from baton_kernels.attention.base import AttentionMetadata, KVCacheView
from baton_kernels.triton.decode_attention import (
    DecodeNorm,
    DecodeRope,
    choose_num_splits,
    decode_attention,
    decode_launches,
    split_counts,
)
from baton_kernels.triton.kv_write import write_kv_cache
from baton_kernels.triton.paged_attention import paged_attention

# forward_rope on a decode-only step: the decode kernel rotates q and writes the new K/V
# itself (one launch a layer instead of two); False keeps the rotary kernel (for A/B runs).
FUSE_DECODE_ROPE = True


class _StepTensors(NamedTuple):
    query_start_loc: torch.Tensor | None  # [num_reqs + 1] int32 on the device, for prefills
    seq_lens: torch.Tensor | None  # [num_reqs] int32, unless the metadata has decode_seq_lens
    max_prefill_len: int  # longest query chunk after the decodes
    num_splits: int  # for the decodes (without a window shorter than max_decode_len)
    max_decode_len: int  # keys of max_decode_blocks


class TritonAttentionBackend:
    """A decode-only step whose metadata carries ``decode_seq_lens`` copies nothing to the device
    and syncs nothing, so it can be captured in a CUDA graph; the split count is then fixed at
    capture, from ``max_decode_blocks`` (capture with the longest length to be replayed)."""

    name = "triton"
    fuses_rope = True  # has forward_rope
    fuses_decode_norm = True  # forward_rope takes a folded norm on decode-only steps
    fuses_prompt_norm = True  # ... and on every other step (through the rotary kernel)

    def __init__(self) -> None:
        self._step_key: AttentionMetadata | None = None
        self._step: _StepTensors | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.slot_block, metadata.slot_offset)
        return self._attend(query, kv_cache, metadata, scale, window=window, softcap=softcap)

    def forward_rope(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        scale: float,
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,  # [max_positions, 2, head_dim]
        norm: DecodeNorm | None = None,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """``forward`` of q and k rotated by ``positions`` (``fused.rotary_embedding_``), the
        rotation and the cache write in one launch; on a decode-only step, in the decode
        kernel's launch (``FUSE_DECODE_ROPE``; ``query`` and ``key`` are then left as they
        are), else in place before the attention. ``norm``: q, k and v are a folded
        projection's, still to be normed (``DecodeNorm``, its stream one row a token), in the
        same launch (the decode kernel's, or the rotary kernel's, which stores q normed)."""
        from baton_kernels.triton.fused_ops import rotary_embedding_and_write_kv_

        decode_only = metadata.num_decodes == metadata.num_reqs
        if FUSE_DECODE_ROPE and decode_only:
            rope = DecodeRope(
                positions, cos_sin, key, value, metadata.slot_block, metadata.slot_offset, norm
            )
            return self._attend(query, kv_cache, metadata, scale, rope, window, softcap)
        rotary_embedding_and_write_kv_(
            query, key, value, positions, cos_sin, kv_cache.kv, metadata.slot_block,
            metadata.slot_offset,
            norm_of=None if norm is None else norm.stream,
            eps=0.0 if norm is None else norm.eps,
            bias=None if norm is None else norm.bias,
            k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale,
        )  # fmt: skip
        return self._attend(query, kv_cache, metadata, scale, window=window, softcap=softcap)

    def _attend(
        self,
        query: torch.Tensor,
        kv_cache: KVCacheView,
        md: AttentionMetadata,
        scale: float,
        rope: DecodeRope | None = None,  # a decode-only step's rotation and cache write
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        step = self._step_tensors(md, kv_cache, query.device)
        out = query.new_empty(query.shape)
        nd = md.num_decodes
        if nd:
            seq_lens = md.decode_seq_lens if md.decode_seq_lens is not None else step.seq_lens
            assert seq_lens is not None
            num_splits = step.num_splits
            if 0 < window < step.max_decode_len:  # split the keys read, the window's
                num_splits = choose_num_splits(nd, kv_cache.kv.shape[3], window, query.device)
            decode_attention(
                query[:nd],
                kv_cache,
                out[:nd],
                seq_lens[:nd],
                md.block_tables[:nd],
                scale,
                num_splits,
                window=window,
                softcap=softcap,
                rope=rope,
            )
        if nd < md.num_reqs:
            assert step.query_start_loc is not None and step.seq_lens is not None
            paged_attention(
                query,
                kv_cache,
                out,
                step.query_start_loc[nd:],
                step.seq_lens[nd:],
                md.block_tables[nd:],
                scale,
                step.max_prefill_len,
                window=window,
                softcap=softcap,
            )
        return out

    def warmup(
        self,
        kv_cache: KVCacheView,
        num_heads: int,
        *,
        window: int = 0,
        softcap: float = 0.0,
        max_seq_len: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Compile every kernel variant a step can launch (two per decode split count and
        launch, with and without the rotation; the prefill kernel, the cache write) now, so
        that no request waits ~1 s for Triton's JIT the first time a batch shape needs a new
        one. Writes nothing into the cache. The variants are those of a layer with this
        ``window`` and ``softcap`` (whether each is > 0, and the split counts that a decode of
        at most ``max_seq_len`` keys, or of the window's, can take): call it once per set of
        options the model's layers use. ``dtype``: the model's (default: the cache's)."""
        kv = kv_cache.kv
        dev, head_dim = kv.device, kv.shape[-1]
        dtype = dtype or kv.dtype
        query = torch.randn((1, num_heads, head_dim), dtype=dtype, device=dev)
        out = torch.empty_like(query)
        table = torch.zeros((1, 1), dtype=torch.int64, device=dev)
        one = torch.ones(1, dtype=torch.int64, device=dev)
        key = torch.randn((1, kv.shape[3], head_dim), dtype=dtype, device=dev)
        cos_sin = torch.ones((1, 2, head_dim), device=dev)
        skip = torch.full_like(one, -1)  # slot -1: no K/V written
        keys = [n for n in (window, max_seq_len) if n]  # (a window splits the keys it reads)
        for splits in split_counts(min(keys, default=None)):
            for tile, warps, stages in set(decode_launches(head_dim, splits)):
                launch = functools.partial(
                    decode_attention, query, kv_cache, out, one, table, 1.0, splits,
                    window=window, softcap=softcap, tile_n=tile, num_warps=warps,
                    num_stages=stages,
                )  # fmt: skip
                launch()
                launch(rope=DecodeRope(one - 1, cos_sin, key, key, skip, one))
        write_kv_cache(key, key, kv_cache, skip, one)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        prefill = functools.partial(
            paged_attention, query, kv_cache, out, cu, one.to(torch.int32), table, 1.0,
            window=window, softcap=softcap,
        )  # fmt: skip
        prefill(1)
        prefill(64)

    def _step_tensors(
        self, md: AttentionMetadata, kv_cache: KVCacheView, device: torch.device
    ) -> _StepTensors:
        if self._step is not None and self._step_key is md:
            return self._step
        nd = md.num_decodes
        qsl = md.query_start_loc
        has_prefills = nd < md.num_reqs
        max_prefill_len = max((qsl[i + 1] - qsl[i] for i in range(nd, md.num_reqs)), default=0)
        num_splits = 1
        max_len = md.max_decode_blocks * kv_cache.block_size
        if nd:
            num_splits = choose_num_splits(nd, kv_cache.kv.shape[3], max_len, device)
        seq_lens = md.seq_lens_tensor
        if seq_lens is None and (has_prefills or md.decode_seq_lens is None):
            seq_lens = torch.tensor(md.seq_lens, dtype=torch.int32).to(device, non_blocking=True)
        query_start_loc = md.query_start_loc_tensor
        if query_start_loc is None and has_prefills:
            query_start_loc = torch.tensor(qsl, dtype=torch.int32).to(device, non_blocking=True)
        self._step = _StepTensors(query_start_loc, seq_lens, max_prefill_len, num_splits, max_len)
        self._step_key = md
        return self._step
