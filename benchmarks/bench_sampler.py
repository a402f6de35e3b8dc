"""The sampler's time per step on CPU, and the Exp(1) draws of its exponential race.

    python benchmarks/bench_sampler.py [--vocab 49152] [--rows 16,64] [--iters 30]

For each row count: ``Sampler`` on float32 logits, all greedy, all at temperature 1 and at
temperature 1 with top-p 0.9; then the race's draws alone, torch's ``exponential_`` against
``baton_engine.sampler.exponentials_`` (``-log(U)`` on CPUs). Median milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from baton_engine.sampler import Sampler, SamplingMetadata, exponentials_
from baton_engine.sampling_params import SamplingParams


def median_ms(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_rows(sampler: Sampler, rows: int, vocab: int, iters: int) -> list[tuple[str, float]]:
    logits = torch.randn(rows, vocab) * 3
    cases = {
        "Sampler, greedy": SamplingParams(temperature=0.0),
        "Sampler, temperature 1": SamplingParams(temperature=1.0),
        "Sampler, temperature 1, top-p": SamplingParams(temperature=1.0, top_p=0.9),
    }
    out = []
    for name, params in cases.items():
        meta = SamplingMetadata.from_params([params] * rows, [[]] * rows, [[]] * rows, {})
        out.append((name, median_ms(lambda meta=meta: sampler(logits, meta), iters)))
    q = torch.empty_like(logits)
    out.append(("draws, exponential_", median_ms(q.exponential_, iters)))
    out.append(("draws, exponentials_", median_ms(lambda: exponentials_(q), iters)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", default="16,64")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    sampler = Sampler()
    print(f"{'rows':>5} {'case':<28} {'ms':>8}")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, ms in time_rows(sampler, rows, args.vocab, args.iters):
            print(f"{rows:>5} {name:<28} {ms:>8.2f}")


if __name__ == "__main__":
    main()
