"""The KV block pool's free queue under issue 5's workload, against the ``OrderedDict`` queue it
replaced (kept here as the baseline), in the same run.

    python benchmarks/bench_block_pool.py [--num-blocks 600000] [--runs 12]

Each run: 256 requests take 32 blocks each (512-token prompts), then 16 decode rounds take one
more block each (256 tokens), then the requests are freed tail first in groups of 32 (they
finish a step apart in the engine). A GPU's pool for Qwen2.5-0.5B on an H200 holds ~600k
blocks. Prints, per queue, the median and the worst time of freeing one group and of one
decode round's allocations: a worst far above the median is a stall in one engine step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable

from baton_engine.kv_cache.block_pool import BlockPool, KVCacheBlock


class OrderedDictPool:
    """The free queue before (until the twenty-ninth session): block id -> block in an
    ``OrderedDict``, in eviction order; what this benchmark compares against."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block


def lifecycle(pool: BlockPool | OrderedDictPool, runs: int) -> tuple[list[float], list[float]]:
    """Seconds of each group's free and of each decode round's allocations."""
    frees: list[float] = []
    allocs: list[float] = []
    for _ in range(runs):
        tables = [pool.get_new_blocks(32) for _ in range(256)]
        for _ in range(16):
            start = time.perf_counter()
            for table in tables:
                table.extend(pool.get_new_blocks(1))
            allocs.append(time.perf_counter() - start)
        for group in range(8):
            start = time.perf_counter()
            for table in tables[group * 32 : (group + 1) * 32]:
                pool.free_blocks(reversed(table))
            frees.append(time.perf_counter() - start)
    return frees, allocs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-blocks", type=int, default=600_000)
    p.add_argument("--runs", type=int, default=12)
    args = p.parse_args()
    print(f"pool of {args.num_blocks:,} blocks, {args.runs} runs of 256 requests x 48 blocks")
    print(f"{'queue':12} {'free a group: median ms':>24} {'worst ms':>9} "
          f"{'256 allocations: median ms':>27} {'worst ms':>9}")  # fmt: skip
    for name, make in (("linked list", BlockPool), ("OrderedDict", OrderedDictPool)):
        frees, allocs = lifecycle(make(args.num_blocks), args.runs)
        print(f"{name:12} {statistics.median(frees) * 1e3:24.3f} {max(frees) * 1e3:9.2f} "
              f"{statistics.median(allocs) * 1e3:27.3f} {max(allocs) * 1e3:9.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
