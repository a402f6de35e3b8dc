"""KV caches for the attention benchmarks: a block-major pool of random values whose requests
hold blocks scattered at random, as an engine's do after some traffic."""

from __future__ import annotations

import math
import random

import torch

from baton_kernels.attention import KVCacheView


def scattered_pool(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_layers: int = 2,
) -> tuple[list[KVCacheView], torch.Tensor]:
    """Every layer's view of a pool of ``num_layers`` layers (a block holds every layer's K/V,
    as the engine's pool does) with room for ``seq_lens``, and the requests' block tables
    ``[num_reqs, max_blocks]``: blocks assigned in a shuffled order (seeded)."""
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    pool = torch.empty(
        num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    pool.normal_()
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64)
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor(order[at : at + n])
        at += n
    return [KVCacheView(pool[:, i]) for i in range(num_layers)], table.to(device)
