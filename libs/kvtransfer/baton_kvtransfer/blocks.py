"""The KV pool as this library sees it: one contiguous tensor whose first dimension is the
block id, so block ``b`` is the byte range ``[b * block_bytes, (b + 1) * block_bytes)`` from
the pool's base address, all layers, K and V included. The layout inside a block is the
engine's business (it is covered by the compatibility hash); only whole blocks move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class BlockRun(NamedTuple):
    """``num_blocks`` blocks contiguous on both sides: one transfer descriptor."""

    src_block_id: int
    dst_block_id: int
    num_blocks: int


def check_pool(pool: torch.Tensor) -> None:
    if pool.dim() < 1 or pool.shape[0] == 0:
        raise ValueError(f"a KV pool needs at least one block: shape {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError("the KV pool must be one contiguous tensor")


def block_bytes(pool: torch.Tensor) -> int:
    """Bytes of one block: all of ``pool[b]``."""
    return pool[0].numel() * pool.element_size()


def pool_bytes(pool: torch.Tensor) -> torch.Tensor:
    """The pool as a ``[num_blocks, block_bytes]`` uint8 view (no copy)."""
    return pool.view(-1).view(torch.uint8).view(pool.shape[0], -1)


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what} block ids out of range [0, {num_blocks}): {bad[:8]}")


def merge_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[BlockRun]:
    """One run per maximal stretch of pairs consecutive on both sides, in order: source
    ``[4, 5, 6, 9]`` into destination ``[0, 1, 7, 8]`` gives runs 4->0 (2 blocks), 6->7 (1)
    and 9->8 (1)."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks"
        )
    runs: list[BlockRun] = []
    for src, dst in zip(src_block_ids, dst_block_ids, strict=True):
        if runs:
            last = runs[-1]
            if (
                src == last.src_block_id + last.num_blocks
                and dst == last.dst_block_id + last.num_blocks
            ):
                runs[-1] = last._replace(num_blocks=last.num_blocks + 1)
                continue
        runs.append(BlockRun(src, dst, 1))
    return runs


def split_runs(runs: Sequence[BlockRun], max_blocks: int) -> list[BlockRun]:
    """``runs`` with every run longer than ``max_blocks`` cut into pieces of at most that many
    blocks, in order (more descriptors, which a transport may move side by side)."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1: {max_blocks}")
    out: list[BlockRun] = []
    for run in runs:
        for start in range(0, run.num_blocks, max_blocks):
            n = min(max_blocks, run.num_blocks - start)
            out.append(BlockRun(run.src_block_id + start, run.dst_block_id + start, n))
    return out
