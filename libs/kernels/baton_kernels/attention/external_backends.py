"""Backends over third-party attention libraries, created only when their package imports.

Neither package imports on the machines this was written on (nor on the H200 image), so these are
thin adapters that have not been run; ``triton`` is the tested GPU backend. Both write the new
K/V with the reference writer and attend the whole mixed batch in one library call.
"""

from __future__ import annotations

from typing import Any

import torch

from baton_kernels.attention.base import AttentionMetadata, KVCacheView
from baton_kernels.attention.torch_backend import write_kv_cache


def _cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _refuse_options(backend: str, window: int, softcap: float) -> None:
    """Baton does not pass a sliding window or a softcap to these libraries (its own backends
    compute them): a model that needs one is an error, not silently full attention."""
    if window or softcap:
        raise ValueError(
            f"the {backend} attention backend does not compute sliding-window attention or "
            "softcapped scores here; use --attention-backend triton"
        )


class FlashAttnBackend:
    """flash-attn 2's ``flash_attn_varlen_func`` with a block table. It aligns the causal mask
    to the end of the keys, as a chunk over cached context needs, but its paged KV requires
    ``block_size`` to be a multiple of 256."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func

        self._varlen: Any = flash_attn_varlen_func

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
        _refuse_options(self.name, window, softcap)
        if kv_cache.block_size % 256:
            raise ValueError(
                f"flash_attn's paged KV needs block_size % 256 == 0, not {kv_cache.block_size}"
            )
        write_kv_cache(key, value, kv_cache, md)
        query_lens = [md.query_len(i) for i in range(md.num_reqs)]
        out: torch.Tensor = self._varlen(
            query,
            kv_cache.key,
            kv_cache.value,
            _cu_seqlens(query_lens, query.device),
            _cu_seqlens(md.seq_lens, query.device),
            max(query_lens),
            max(md.seq_lens),
            softmax_scale=scale,
            causal=True,
            block_table=md.block_tables.to(torch.int32),
        )
        return out


class FlashInferBackend:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (NHD layout, which is the cache's
    per-layer layout). Planned once per step, on the first layer that sees its metadata."""

    name = "flashinfer"
    WORKSPACE_BYTES = 128 * 1024 * 1024

    def __init__(self) -> None:
        import flashinfer

        self._flashinfer: Any = flashinfer
        self._wrapper: Any = None
        self._planned_for: AttentionMetadata | None = None

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
        _refuse_options(self.name, window, softcap)
        write_kv_cache(key, value, kv_cache, md)
        if self._wrapper is None:
            workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
            self._wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        if self._planned_for is not md:
            self._plan(query, kv_cache, md, scale)
        out: torch.Tensor = self._wrapper.run(query, (kv_cache.key, kv_cache.value))
        return out

    def _plan(
        self, query: torch.Tensor, kv_cache: KVCacheView, md: AttentionMetadata, scale: float
    ) -> None:
        bs = kv_cache.block_size
        num_pages = [-(s // -bs) for s in md.seq_lens]
        pages = torch.arange(md.block_tables.shape[1], device=md.block_tables.device)
        used = pages[None, :] < torch.tensor(num_pages, device=pages.device)[:, None]
        last_page_lens = [s - (n - 1) * bs for s, n in zip(md.seq_lens, num_pages, strict=True)]
        self._wrapper.plan(
            torch.tensor(md.query_start_loc, dtype=torch.int32, device=query.device),
            _cu_seqlens(num_pages, query.device),
            md.block_tables[used].to(torch.int32),
            torch.tensor(last_page_lens, dtype=torch.int32, device=query.device),
            query.shape[1],
            kv_cache.kv.shape[3],
            query.shape[2],
            bs,
            causal=True,
            sm_scale=scale,
            q_data_type=query.dtype,
            kv_data_type=kv_cache.kv.dtype,
        )
        self._planned_for = md
