"""The reference attention backend: plain PyTorch over the paged cache (CPU and GPU).

Decodes are batched: their blocks are gathered into one padded tensor and attended with a
validity mask, treating the query heads that share a KV head as that head's query rows. Prefill
chunks run one request at a time; a chunk with no cached context attends to its own fresh K/V
without touching the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton_kernels.attention.base import AttentionMetadata, KVCacheView


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: KVCacheView, metadata: AttentionMetadata
) -> None:
    kv_cache.key[metadata.slot_block, metadata.slot_offset] = key
    kv_cache.value[metadata.slot_block, metadata.slot_offset] = value


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request's blocks: ``[seq_len, num_kv_heads, dim]``."""
    blocks = cache[block_ids]  # [num_blocks, block_size, num_kv_heads, dim]
    return blocks.flatten(0, 1)[:seq_len]


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
        write_kv_cache(key, value, kv_cache, metadata)
        out = torch.empty_like(query)
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self._decode(query[:nd], kv_cache, metadata, scale)
        for i in range(nd, metadata.num_reqs):
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            out[start:end] = self._prefill(
                query[start:end], key[start:end], value[start:end], kv_cache, metadata, i, scale
            )
        return out

    def _decode(
        self, query: torch.Tensor, kv_cache: KVCacheView, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        nd, num_heads, dim = query.shape
        num_kv_heads = kv_cache.key.shape[2]
        group = num_heads // num_kv_heads
        tables = md.block_tables[:nd, : md.max_decode_blocks]
        # [nd, blocks, block_size, kvh, d] -> [nd, kvh, len, d]
        k = kv_cache.key[tables].flatten(1, 2).transpose(1, 2)
        v = kv_cache.value[tables].flatten(1, 2).transpose(1, 2)
        # The `group` query heads sharing a KV head become that head's query rows.
        q = query.view(nd, num_kv_heads, group, dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=md.decode_mask, scale=scale)
        return out.reshape(nd, num_heads, dim)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCacheView,
        md: AttentionMetadata,
        i: int,
        scale: float,
    ) -> torch.Tensor:
        query_len = query.shape[0]
        seq_len = md.seq_lens[i]
        q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
        if seq_len == query_len:  # no cached context: the fresh K/V are the whole sequence
            k, v, mask, causal = key, value, None, True
        else:
            num_blocks = -(seq_len // -kv_cache.key.shape[1])
            block_ids = md.block_tables[i, :num_blocks]
            k = gather_kv(kv_cache.key, block_ids, seq_len)
            v = gather_kv(kv_cache.value, block_ids, seq_len)
            # Query row r sits at position seq_len - query_len + r and sees keys up to it.
            rows = torch.arange(seq_len - query_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= rows[:, None]
            causal = False
        out = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)
