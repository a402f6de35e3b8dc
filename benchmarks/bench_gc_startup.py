"""What the cyclic GC's passes cost after an engine-sized start-up heap, with and without one
full collection at the end of start-up (what ``EngineCore`` does since the twenty-ninth
session).

    python benchmarks/bench_gc_startup.py

Each variant in a fresh process: a KV block pool of ``--num-blocks`` blocks (a GPU's pool for
Qwen2.5-0.5B on an H200 holds ~600k), the engine's GC thresholds, then six rounds of 500k
objects allocated and released (a run's worth of requests' objects). Prints each variant's
collections by generation and the longest pauses (gc.callbacks).
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time


def child(num_blocks: int, collect: bool) -> None:
    from baton_engine.core.engine_core import _GC_THRESHOLDS
    from baton_engine.kv_cache.block_pool import BlockPool

    gc.set_threshold(*_GC_THRESHOLDS)
    pool = BlockPool(num_blocks)
    note = ""
    if collect:
        start = time.perf_counter()
        gc.collect()
        note = f", the start-up collection {(time.perf_counter() - start) * 1e3:.1f} ms"
    pauses: list[tuple[int, float]] = []
    began = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - began[0]) * 1e3))

    gc.callbacks.append(on_gc)
    for _ in range(6):
        keep = [[i] for i in range(500_000)]
        del keep
    gc.callbacks.remove(on_gc)
    worst = sorted(pauses, key=lambda p: -p[1])[:3]
    by_gen = [sum(1 for g, _ in pauses if g == k) for k in range(3)]
    print(f"{'collect' if collect else 'as is':8} pool {len(pool.blocks):,} blocks{note}: "
          f"collections by generation {by_gen}, longest (generation, ms) "
          + ", ".join(f"({g}, {ms:.1f})" for g, ms in worst))  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-blocks", type=int, default=600_000)
    p.add_argument("--child", choices=("as-is", "collect"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.num_blocks, args.child == "collect")
        return 0
    for variant in ("as-is", "collect"):
        cmd = [sys.executable, __file__, "--num-blocks", str(args.num_blocks), "--child", variant]
        subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
