"""The reference attention backend: plain PyTorch over the paged cache (CPU and GPU).

Decodes are batched: their blocks are gathered into one padded tensor and attended with an
additive mask, treating the query heads that share a KV head as that head's query rows. Prefill
chunks with no cached context attend to their own fresh K/V without reading the cache, and runs
of such chunks of equal length are batched into one call; chunks with context run one at a time.
A sliding window becomes part of the mask; a softcap computes the same attention by hand (SDPA
has no softcap), in float32. An 8-bit cache is written rounded (``to_cache_dtype``) and its
blocks read back as the query's dtype; a fresh chunk attends to its K/V rounded so too, as the
Triton kernels (which read every key from the cache) do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton_kernels.attention.base import (
    FP8_KV_DTYPES,
    AttentionMetadata,
    KVCacheView,
    from_cache,
    to_cache_dtype,
)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: KVCacheView, metadata: AttentionMetadata
) -> None:
    dtype, slots = kv_cache.kv.dtype, (metadata.slot_block, metadata.slot_offset)
    kv_cache.key[slots] = to_cache_dtype(key, dtype, kv_cache.k_scale)
    kv_cache.value[slots] = to_cache_dtype(value, dtype, kv_cache.v_scale)


def as_cached(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` (and ``scale``) gives it back, in ``x``'s dtype."""
    return from_cache(to_cache_dtype(x, dtype, scale), x.dtype, scale)


def gather_blocks(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    dtype: torch.dtype | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """``[num_reqs, num_blocks * block_size, num_kv_heads, dim]`` from a ``[num_reqs,
    num_blocks]`` table, one contiguous copy (as ``dtype``, if given: ``from_cache``)."""
    num_reqs, num_blocks = block_tables.shape
    _, block_size, num_kv_heads, dim = cache.shape
    rows = cache.index_select(0, block_tables.flatten())
    if dtype is not None:
        rows = from_cache(rows, dtype, scale)
    return rows.view(num_reqs, num_blocks * block_size, num_kv_heads, dim)


def attention(
    q: torch.Tensor,  # [..., num_heads, M, D]
    k: torch.Tensor,  # [..., num_kv_heads, N, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool (True: attend) or additive, broadcast to [..., M, N]
    scale: float,
    softcap: float = 0.0,
    is_causal: bool = False,
) -> torch.Tensor:  # [..., num_heads, M, D]
    """``F.scaled_dot_product_attention`` (query heads grouped over the KV heads), or with a
    ``softcap`` the same math by hand in float32, the scores capped before the mask."""
    group = q.shape[-3] // k.shape[-3]
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1
        )
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = q.float() @ k.float().transpose(-1, -2) * (scale / softcap)
    scores = scores.tanh_().mul_(softcap)
    if is_causal:
        mask = causal_mask(q.shape[-2], k.shape[-2], 0, q.device)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def causal_mask(query_len: int, seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """``[query_len, seq_len]`` bool, True where the query (the last ``query_len`` positions)
    sees the key: at or before its position, and within ``window`` of it when ``window`` > 0."""
    rows = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    cols = torch.arange(seq_len, device=device)[None, :]
    visible = cols <= rows
    return visible & (cols > rows - window) if window > 0 else visible


class TorchAttentionBackend:
    name = "torch"

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
        self._write_kv(key, value, kv_cache, metadata)
        md = metadata
        nd = md.num_decodes
        if nd == md.num_reqs:  # decodes only
            return self._decode(query, kv_cache, md, scale, window, softcap)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(query[:nd], kv_cache, md, scale, window, softcap)
        i = nd
        while i < md.num_reqs:
            start, query_len = md.query_start_loc[i], md.query_len(i)
            if md.seq_lens[i] != query_len:  # has cached context
                end = start + query_len
                out[start:end] = self._prefill_with_context(
                    query[start:end], kv_cache, md, i, scale, window, softcap
                )
                i += 1
                continue
            j = i + 1  # batch the following fresh chunks of the same length
            while j < md.num_reqs and md.seq_lens[j] == query_len == md.query_len(j):
                j += 1
            end = md.query_start_loc[j]
            k, v = key[start:end], value[start:end]
            cached = kv_cache.kv.dtype
            if cached in FP8_KV_DTYPES:  # what the cache holds, as every path reads
                k = as_cached(k, cached, kv_cache.k_scale)
                v = as_cached(v, cached, kv_cache.v_scale)
            out[start:end] = self._prefill_fresh(
                query[start:end], k, v, j - i, scale, window, softcap
            )
            i = j
        return out

    def _write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCacheView, md: AttentionMetadata
    ) -> None:
        write_kv_cache(key, value, kv_cache, md)

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: KVCacheView,
        md: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        nd, num_heads, dim = query.shape
        num_kv_heads = kv_cache.kv.shape[3]
        tables = md.block_tables[:nd, : md.max_decode_blocks]
        k = gather_blocks(kv_cache.key, tables, query.dtype, kv_cache.k_scale)
        v = gather_blocks(kv_cache.value, tables, query.dtype, kv_cache.v_scale)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [nd, kvh, len, d]
        # The query heads sharing a KV head become that head's query rows.
        q = query.view(nd, num_kv_heads, num_heads // num_kv_heads, dim)
        bias = md.decode_bias
        if window > 0:  # the keys before each request's window are masked too
            seq_lens = md.decode_seq_lens
            if seq_lens is None:
                seq_lens = torch.tensor(md.seq_lens[:nd], device=query.device)
            cols = torch.arange(k.shape[2], device=query.device)
            before = (cols[None, :] < (seq_lens[:, None] - window)).view(nd, 1, 1, -1)
            bias = torch.zeros_like(k[:, :1, :1, :, 0]) if bias is None else bias
            bias = bias.masked_fill(before, float("-inf"))
        out = attention(q, k, v, bias, scale, softcap)
        return out.reshape(nd, num_heads, dim)

    def _prefill_fresh(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        n: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """``n`` equal-length chunks that start at position 0: plain causal attention."""
        num_tokens, num_heads, dim = query.shape

        def heads_first(x: torch.Tensor) -> torch.Tensor:
            return x.view(n, num_tokens // n, x.shape[1], dim).transpose(1, 2)

        length = num_tokens // n
        mask = causal_mask(length, length, window, query.device) if 0 < window < length else None
        out = attention(
            heads_first(query),
            heads_first(key),
            heads_first(value),
            mask,
            scale,
            softcap,
            is_causal=mask is None,
        )
        return out.transpose(1, 2).reshape(num_tokens, num_heads, dim)

    def _prefill_with_context(
        self,
        query: torch.Tensor,
        kv_cache: KVCacheView,
        md: AttentionMetadata,
        i: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        query_len, seq_len = query.shape[0], md.seq_lens[i]
        num_blocks = -(seq_len // -kv_cache.block_size)
        table = md.block_tables[i : i + 1, :num_blocks]
        k = gather_blocks(kv_cache.key, table, query.dtype, kv_cache.k_scale)
        v = gather_blocks(kv_cache.value, table, query.dtype, kv_cache.v_scale)
        k, v = k[:, :seq_len].transpose(1, 2), v[:, :seq_len].transpose(1, 2)
        # Query row r sits at position seq_len - query_len + r and sees keys up to it.
        mask = causal_mask(query_len, seq_len, window, query.device)
        out = attention(query.transpose(0, 1).unsqueeze(0), k, v, mask, scale, softcap)
        return out.squeeze(0).transpose(0, 1)
