"""The load generator of ``baton bench serve``: paces requests, caps those in flight, records.

Arrivals follow :func:`arrival_gaps` (all at once, Poisson or gamma); ``max_concurrency`` caps
the requests in flight (a request that arrives while the cap is reached waits for a slot, and
its timing starts when it is sent). Results land in a :class:`RunState` as they finish, so a
cancelled run (Ctrl-C) still has everything that completed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from baton.bench.client import RequestConfig, send_request
from baton.bench.datasets import SampleRequest
from baton.bench.metrics import RequestResult
from baton_engine.errors import BatonError

_INITIAL_TEST_TOKENS = 8  # the test request's output is capped to keep it short


class BenchmarkError(BatonError):
    """The benchmark cannot run as asked (bad arguments, server unreachable, test failed)."""


@dataclass(frozen=True, slots=True)
class LoadShape:
    """How requests are sent."""

    request_rate: float = float("inf")  # requests/s; inf: all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1: Poisson
    max_concurrency: int | None = None  # None: no cap
    seed: int = 0  # of the arrival gaps
    initial_test: bool = True  # one short request first; a failure stops the run
    show_progress: bool = True


@dataclass
class RunState:
    """Filled while the benchmark runs, so that Ctrl-C can still report what finished."""

    results: list[RequestResult | None]  # by sample index; None: not finished
    start: float | None = None  # perf_counter when the first request was sent
    end: float | None = None  # perf_counter when the last one finished


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait after sending each of ``num`` requests before sending the next.

    Gamma-distributed with mean ``1 / rate`` and shape ``burstiness`` (1: exponential gaps, a
    Poisson process; below 1 burstier, above 1 more regular); all zeros when ``rate`` is inf.
    The last gap is always 0. Deterministic for a given seed.
    """
    if rate == float("inf") or num < 2:
        return [0.0] * num
    import numpy as np

    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=num - 1)
    return [*map(float, gaps), 0.0]


async def run_benchmark(
    cfg: RequestConfig, samples: Sequence[SampleRequest], shape: LoadShape, state: RunState
) -> None:
    """Send every sample as ``shape`` says, recording results in ``state`` as they finish.

    Raises BenchmarkError if the initial test request fails (``state.start`` stays None then).
    Every request is bounded by ``cfg.timeout_s``, so this returns once all have ended.
    """
    import httpx
    from tqdm.auto import tqdm

    num_conns = shape.max_concurrency or len(samples)
    limits = httpx.Limits(max_connections=num_conns, max_keepalive_connections=num_conns)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 60.0))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if shape.initial_test:
            print("Starting initial single prompt test run...")
            short = min(samples[0].output_len, _INITIAL_TEST_TOKENS)
            test = await send_request(client, cfg, replace(samples[0], output_len=short))
            if not test.success:
                raise BenchmarkError(f"the initial test request failed: {test.error}")
            print("Initial test run completed. Starting main benchmark run...")
        gate = asyncio.Semaphore(num_conns)
        with tqdm(total=len(samples), disable=not shape.show_progress) as bar:

            async def one(index: int, sample: SampleRequest) -> None:
                async with gate:
                    state.results[index] = await send_request(client, cfg, sample)
                bar.update(1)

            gaps = arrival_gaps(len(samples), shape.request_rate, shape.burstiness, shape.seed)
            state.start = time.perf_counter()
            tasks = []
            for index, (sample, gap) in enumerate(zip(samples, gaps, strict=True)):
                tasks.append(asyncio.create_task(one(index, sample)))
                if gap:
                    await asyncio.sleep(gap)
            await asyncio.gather(*tasks)
            state.end = time.perf_counter()
