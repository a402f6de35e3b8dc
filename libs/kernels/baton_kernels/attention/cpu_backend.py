"""The CPU backend: attention by C++ kernels that read the paged cache in place, and the new K/V
rows written by a C++ row copy (``csrc/paged_attention_cpu.cpp``); the reference backend where a
shape or dtype has no kernel.

In bf16 on AVX512-BF16 CPUs a batch with prompt tokens is one ``paged_attention`` call: each
prompt token attends to its request's tokens up to its own position, read from the cache;
chunks of 8 or more tokens run as FlashAttention-style tiles (``csrc/prefill_attention_cpu.cpp``),
decodes and shorter chunks row by row like a decode step. Per layer of the default model
(``benchmarks/bench_cpu_kernels.py``): 16 fresh 128-token prompts ~2 ms against ~7 for the
reference's gather + SDPA, a 512-token chunk after 1,536 cached tokens ~10 against ~21; no
gathered copy of a cached prefix. Elsewhere prompts take the reference: the row-by-row kernel
alone is ~2x slower than SDPA on a long cached prefix in float32 (44 vs 23 ms for that chunk).

A sliding window and a softcap run in the kernels too: decodes read only the window's keys and
the tiles skip the key tiles before it, where the reference masks a full-length gather, and
computes a softcap by hand in float32. That 512-token chunk with a window of 256: ~1.5 ms against
~21; with a softcap of 50, ~12 against ~90. Where the kernels don't apply, the reference gets
both options.

On CPUs with AMX, torch's SDPA (oneDNN on the tiles) beats the tiles' VDPBF16PS products: there
prompts without a window or softcap take the reference (``SDPA_PROMPTS_ON_AMX``; decodes stay in
the kernel). On a 2-core AMX VM, that 512-token chunk 5.7 ms against 14.7, 16 fresh 128-token
prompts 2.1 against 2.6.

An 8-bit cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``) is written and read by the same kernels:
writes divide by the layer's scale, saturate and round as the reference; reads widen the 8-bit
values to bf16 / float32 exactly, K's scale folded into the scores' and V's into the output."""

from __future__ import annotations

from typing import Any

import torch

from baton_kernels.attention.base import FP8_KV_DTYPES, AttentionMetadata, KVCacheView
from baton_kernels.attention.torch_backend import TorchAttentionBackend

KERNEL_HEAD_SIZES = (64, 128, 256)  # (256: Gemma 2 and 3)
KERNEL_MAX_GROUP = 16
# On CPUs with AMX, prompts without a window or softcap take SDPA (False: the tiles everywhere)
SDPA_PROMPTS_ON_AMX = True


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.prompt_tiles = bool(ops.bf16_gemm_available())  # AVX512-BF16: the tiled kernel
        # AMX: oneDNN's SDPA is faster than the tiles for prompts without options
        self.sdpa_prompts = SDPA_PROMPTS_ON_AMX and bool(ops.amx_gemm_available())

    def decodes_in_place(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether ``_decode`` runs the C++ kernel for this shape (not the reference)."""
        return head_dim in KERNEL_HEAD_SIZES and num_heads // num_kv_heads <= KERNEL_MAX_GROUP

    def _kernel_applies(self, query: torch.Tensor, kv: torch.Tensor) -> bool:
        return (
            query.device.type == "cpu"
            and query.dtype in (torch.float32, torch.bfloat16)
            and (kv.dtype == query.dtype or kv.dtype in FP8_KV_DTYPES)
            and self.decodes_in_place(query.shape[1], kv.shape[3], query.shape[2])
        )

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
        md = metadata
        if (
            md.num_decodes == md.num_reqs
            or query.dtype != torch.bfloat16
            or not self.prompt_tiles
            or (self.sdpa_prompts and not window and not softcap)
            or not self._kernel_applies(query, kv_cache.kv)
        ):
            return super().forward(
                query, key, value, kv_cache, md, scale, window=window, softcap=softcap
            )
        self._write_kv(key, value, kv_cache, md)
        out: torch.Tensor = self.ops.paged_attention(
            query,
            kv_cache.key,
            kv_cache.value,
            md.block_tables,
            torch.tensor(md.seq_lens, dtype=torch.int64),
            torch.tensor(md.query_start_loc, dtype=torch.int64),
            scale,
            window,
            softcap,
            kv_cache.k_scale,
            kv_cache.v_scale,
        )
        return out

    def _write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCacheView, md: AttentionMetadata
    ) -> None:
        kv = kv_cache.kv
        # the rows as they are, or rounded into an 8-bit cache
        narrowed = kv.dtype in FP8_KV_DTYPES and key.dtype in (torch.float32, torch.bfloat16)
        if (
            key.device.type != "cpu"
            or not (key.dtype == kv.dtype or narrowed)
            or value.dtype != key.dtype
            or key.stride(2) != 1
            or key.stride(1) != key.shape[2]
            or value.stride(2) != 1
            or value.stride(1) != value.shape[2]
            or kv.stride(4) != 1
            or kv.stride(3) != kv.shape[4]
        ):
            super()._write_kv(key, value, kv_cache, md)
            return
        self.ops.write_kv_cache_(
            key, value, kv, md.slot_block, md.slot_offset, kv_cache.k_scale, kv_cache.v_scale
        )

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: KVCacheView,
        md: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        if not self._kernel_applies(query, kv_cache.kv) or md.decode_seq_lens is None:
            return super()._decode(query, kv_cache, md, scale, window, softcap)
        nd = query.shape[0]
        out: torch.Tensor = self.ops.paged_decode_attention(
            query,
            kv_cache.key,
            kv_cache.value,
            md.block_tables[:nd],
            md.decode_seq_lens,
            scale,
            window,
            softcap,
            kv_cache.k_scale,
            kv_cache.v_scale,
        )
        return out
