"""The reference attention backend: plain PyTorch over the paged cache (CPU and GPU).

Decodes are batched: their blocks are gathered into one padded tensor and attended with an
additive mask, treating the query heads that share a KV head as that head's query rows. Prefill
chunks with no cached context attend to their own fresh K/V without reading the cache, and runs
of such chunks of equal length are batched into one call; chunks with context run one at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton_kernels.attention.base import AttentionMetadata, KVCacheView


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: KVCacheView, metadata: AttentionMetadata
) -> None:
    kv_cache.kv[metadata.slot_block, 0, metadata.slot_offset] = key
    kv_cache.kv[metadata.slot_block, 1, metadata.slot_offset] = value


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """``[num_reqs, num_blocks * block_size, num_kv_heads, dim]`` from a ``[num_reqs,
    num_blocks]`` table, one contiguous copy."""
    num_reqs, num_blocks = block_tables.shape
    _, block_size, num_kv_heads, dim = cache.shape
    rows = cache.index_select(0, block_tables.flatten())
    return rows.view(num_reqs, num_blocks * block_size, num_kv_heads, dim)


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
    ) -> torch.Tensor:
        self._write_kv(key, value, kv_cache, metadata)
        md = metadata
        nd = md.num_decodes
        if nd == md.num_reqs:  # decodes only
            return self._decode(query, kv_cache, md, scale)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(query[:nd], kv_cache, md, scale)
        i = nd
        while i < md.num_reqs:
            start, query_len = md.query_start_loc[i], md.query_len(i)
            if md.seq_lens[i] != query_len:  # has cached context
                end = start + query_len
                out[start:end] = self._prefill_with_context(
                    query[start:end], kv_cache, md, i, scale
                )
                i += 1
                continue
            j = i + 1  # batch the following fresh chunks of the same length
            while j < md.num_reqs and md.seq_lens[j] == query_len == md.query_len(j):
                j += 1
            end = md.query_start_loc[j]
            out[start:end] = self._prefill_fresh(
                query[start:end], key[start:end], value[start:end], j - i, scale
            )
            i = j
        return out

    def _write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCacheView, md: AttentionMetadata
    ) -> None:
        write_kv_cache(key, value, kv_cache, md)

    def _decode(
        self, query: torch.Tensor, kv_cache: KVCacheView, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        nd, num_heads, dim = query.shape
        num_kv_heads = kv_cache.kv.shape[3]
        tables = md.block_tables[:nd, : md.max_decode_blocks]
        k = gather_blocks(kv_cache.key, tables).transpose(1, 2)  # [nd, kvh, len, d]
        v = gather_blocks(kv_cache.value, tables).transpose(1, 2)
        # The query heads sharing a KV head become that head's query rows.
        q = query.view(nd, num_kv_heads, num_heads // num_kv_heads, dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=md.decode_bias, scale=scale)
        return out.reshape(nd, num_heads, dim)

    def _prefill_fresh(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n: int, scale: float
    ) -> torch.Tensor:
        """``n`` equal-length chunks that start at position 0: plain causal attention."""
        num_tokens, num_heads, dim = query.shape

        def heads_first(x: torch.Tensor) -> torch.Tensor:
            return x.view(n, num_tokens // n, x.shape[1], dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads_first(query),
            heads_first(key),
            heads_first(value),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(num_tokens, num_heads, dim)

    def _prefill_with_context(
        self,
        query: torch.Tensor,
        kv_cache: KVCacheView,
        md: AttentionMetadata,
        i: int,
        scale: float,
    ) -> torch.Tensor:
        query_len, seq_len = query.shape[0], md.seq_lens[i]
        num_blocks = -(seq_len // -kv_cache.block_size)
        table = md.block_tables[i : i + 1, :num_blocks]
        k = gather_blocks(kv_cache.key, table)[:, :seq_len].transpose(1, 2)
        v = gather_blocks(kv_cache.value, table)[:, :seq_len].transpose(1, 2)
        # Query row r sits at position seq_len - query_len + r and sees keys up to it.
        rows = torch.arange(seq_len - query_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= rows[:, None]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1)
