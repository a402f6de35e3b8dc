"""The interface every attention backend implements, and the per-step metadata it reads.

Token layout of one step (decodes first, then prefill chunks):

    query tokens: | d0 | d1 | d2 |  p0 chunk ...  |  p1 chunk ...  |
    requests:       0    1    2        3                4
    query_start_loc: [0, 1, 2, 3, 3 + len(p0), 3 + len(p0) + len(p1)]

A request's keys are its ``seq_len`` tokens: the ``seq_len - query_len`` already in the paged cache
followed by the ``query_len`` new ones, which are written to the cache before attention runs.

Two options of a layer's attention change what a query sees (both off by default):

- ``window`` W > 0 (sliding-window attention: Mistral-7B-v0.1, Gemma 2/3's local layers): the
  query at position p attends to the keys at positions p - W < j <= p only (W keys, its own
  included), as transformers masks them.
- ``softcap`` c > 0 (Gemma 2): each score ``s = scale * q.k`` becomes ``c * tanh(s / c)``
  before the mask and the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

# 8-bit caches (vLLM's ``--kv-cache-dtype fp8`` / ``fp8_e4m3``, ``fp8_e5m2``): K and V are
# stored divided by their layer's scale (``KVCacheView.k_scale`` / ``v_scale``: a checkpoint's
# calibrated ones, else 1, as vLLM), rounded to the 8-bit float, saturated at its largest finite
# value, and read back as the model's dtype times the scale.
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def cache_max(dtype: torch.dtype) -> float:
    """The largest finite value an 8-bit cache of ``dtype`` holds (what writes saturate at);
    0.0 for a 16- or 32-bit cache (no saturation)."""
    return float(torch.finfo(dtype).max) if dtype in FP8_KV_DTYPES else 0.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: for an 8-bit float, ``x / scale`` (in float32,
    as ``x`` times the float32 of ``1 / scale``, as the kernels do) saturated (torch's cast
    would make NaN of what it cannot hold)."""
    if dtype in FP8_KV_DTYPES and x.dtype != dtype:
        top = cache_max(dtype)
        if scale != 1.0:
            x = x.float() * (1.0 / scale)
        return x.clamp(-top, top).to(dtype)
    return x.to(dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What a cache's ``x`` holds, in ``dtype``: times ``scale`` for an 8-bit float."""
    if x.dtype in FP8_KV_DTYPES and scale != 1.0:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def copy_blocks_(pool: torch.Tensor, index: torch.Tensor, blocks: torch.Tensor) -> None:
    """``pool[index] = blocks`` along dim 0 (``index_copy_``), as bytes for an 8-bit pool (torch
    has no ``index_copy_`` of 8-bit floats on CPUs)."""
    if pool.dtype in FP8_KV_DTYPES:
        pool, blocks = pool.view(torch.uint8), blocks.view(torch.uint8)
    pool.index_copy_(0, index, blocks)


class KVCacheView(NamedTuple):
    """One layer's paged cache: a strided view ``[num_blocks, 2, block_size, num_kv_heads,
    head_dim]`` into the shared block-major pool (index 0 of dim 1 is K, 1 is V); an 8-bit
    cache's K and V are stored divided by ``k_scale`` and ``v_scale``."""

    kv: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def key(self) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim]
        return self.kv[:, 0]

    @property
    def value(self) -> torch.Tensor:
        return self.kv[:, 1]

    @property
    def block_size(self) -> int:
        return int(self.kv.shape[2])


@dataclass(frozen=True)
class AttentionMetadata:
    num_reqs: int
    num_decodes: int  # the first num_decodes requests have query_len == 1
    num_tokens: int
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]: cached + new tokens
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int64; padding points at block 0
    slot_block: torch.Tensor  # [num_tokens] int64: block id each new token's KV goes to
    slot_offset: torch.Tensor  # [num_tokens] int64: offset inside that block
    # [num_decodes, 1, 1, max_decode_blocks * block_size], model dtype: 0 = attend, -inf = not
    decode_bias: torch.Tensor | None
    max_decode_blocks: int  # blocks the longest decode needs
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64, for in-place kernels
    # query_start_loc and seq_lens already on the device (int32), when the caller staged them
    query_start_loc_tensor: torch.Tensor | None = None
    seq_lens_tensor: torch.Tensor | None = None

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write the new tokens' K/V into the cache, then attend causally over each request's
        cached and new tokens (within ``window`` of each query, scores capped by ``softcap``:
        see the module's docstring)."""
        ...
