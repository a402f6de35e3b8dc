"""The CPU backend: the reference backend with decode attention done by a C++ kernel that reads
the paged cache in place, and the new K/V rows written by a C++ row copy
(``csrc/paged_attention_cpu.cpp``). Prefill chunks use the reference."""

from __future__ import annotations

from typing import Any

import torch

from baton_kernels.attention.base import AttentionMetadata, KVCacheView
from baton_kernels.attention.torch_backend import TorchAttentionBackend

KERNEL_HEAD_SIZES = (64, 128)
KERNEL_MAX_GROUP = 16


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def decodes_in_place(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether ``_decode`` runs the C++ kernel for this shape (not the reference)."""
        return head_dim in KERNEL_HEAD_SIZES and num_heads // num_kv_heads <= KERNEL_MAX_GROUP

    def _write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCacheView, md: AttentionMetadata
    ) -> None:
        kv = kv_cache.kv
        if (
            key.device.type != "cpu"
            or key.dtype != kv.dtype
            or key.stride(2) != 1
            or key.stride(1) != key.shape[2]
            or value.stride(2) != 1
            or value.stride(1) != value.shape[2]
            or kv.stride(4) != 1
            or kv.stride(3) != kv.shape[4]
        ):
            super()._write_kv(key, value, kv_cache, md)
            return
        self.ops.write_kv_cache_(key, value, kv, md.slot_block, md.slot_offset)

    def _decode(
        self, query: torch.Tensor, kv_cache: KVCacheView, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_heads, dim = query.shape[1], query.shape[2]
        group = num_heads // kv_cache.kv.shape[3]
        if (
            query.device.type != "cpu"
            or dim not in KERNEL_HEAD_SIZES
            or group > KERNEL_MAX_GROUP
            or query.dtype not in (torch.float32, torch.bfloat16)
            or md.decode_seq_lens is None
        ):
            return super()._decode(query, kv_cache, md, scale)
        nd = query.shape[0]
        out: torch.Tensor = self.ops.paged_decode_attention(
            query,
            kv_cache.key,
            kv_cache.value,
            md.block_tables[:nd],
            md.decode_seq_lens,
            scale,
        )
        return out
