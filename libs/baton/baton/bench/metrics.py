"""Serving-benchmark metrics: pure functions of per-request timings, no I/O.

Definitions (as in vLLM's ``bench serve``), all per successful request:

- TTFT: from sending the request to the first chunk with non-empty text.
- ITL: the gaps between consecutive chunks with text (a chunk may carry several tokens).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``; undefined for a one-token output (it then counts
  as 0 for goodput and is left out of the TPOT statistics).
- E2E latency: from sending the request to the end of its stream.

Times are seconds in :class:`RequestResult` and milliseconds in :class:`LatencyStats`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may constrain


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request's outcome. Times are seconds; ``start`` is on the ``perf_counter`` clock."""

    prompt_len: int  # tokens
    success: bool
    error: str = ""  # why it failed; empty on success
    start: float = 0.0
    ttft: float = 0.0  # 0.0 when no text arrived
    itl: list[float] = field(default_factory=list)  # gaps between text chunks
    latency: float = 0.0  # end to end
    output_tokens: int = 0  # usage.completion_tokens, else the number of text chunks
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Summary of one latency metric in milliseconds; all zeros when there were no samples."""

    count: int
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # percentile (e.g. 99.0) -> value


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """Everything the report prints, computed by :func:`calculate_metrics`."""

    completed: int
    failed: int
    duration: float  # seconds
    total_input: int  # prompt tokens of completed requests
    total_output: int  # output tokens of completed requests
    request_throughput: float  # completed requests per second
    request_goodput: float | None  # requests per second meeting every SLO; None without SLOs
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # (input + output) tokens per second
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, as numpy computes it;
    0.0 for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    return float(np.percentile(values, q)) if len(values) else 0.0


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
    """Mean, median, standard deviation and ``percentiles`` of ``values_s`` (seconds) in ms."""
    if not len(values_s):
        return LatencyStats(0, 0.0, 0.0, 0.0, {float(p): 0.0 for p in percentiles})
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return LatencyStats(
        count=len(ms),
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        std=float(ms.std()),
        percentiles={float(p): percentile(ms.tolist(), p) for p in percentiles},
    )


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    Raises ValueError for an unknown metric (see SLO_METRICS), a repeated one, or a value that
    is not a positive number.
    """
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes {'|'.join(SLO_METRICS)}:MS pairs, got {spec!r}")
        if name in slos:
            raise ValueError(f"--goodput gives {name} twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name}: {value!r} is not a number") from None
        if not ms > 0:
            raise ValueError(f"--goodput {name}: the SLO must be positive, got {value}")
        slos[name] = ms
    return slos


def meets_slos(result: RequestResult, slos: Mapping[str, float]) -> bool:
    """Whether a request succeeded and met every SLO (milliseconds; a missing TPOT is 0)."""
    if not result.success:
        return False
    observed = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(observed[name] * 1000.0 <= slo for name, slo in slos.items())


def calculate_metrics(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (90.0, 99.0),
    slos: Mapping[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregate per-request results over a benchmark that ran for ``duration`` seconds.

    Only successful requests count towards tokens, throughput and latencies; ``slos`` (metric
    -> milliseconds, see :func:`parse_goodput`) enables goodput. Raises ValueError for a
    non-positive duration.
    """
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    goodput = None
    if slos:
        goodput = sum(meets_slos(r, slos) for r in ok) / duration
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration=duration,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration,
        request_goodput=goodput,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        ttft=summarize([r.ttft for r in ok], percentiles),
        tpot=summarize([t for r in ok if (t := r.tpot) is not None], percentiles),
        itl=summarize([gap for r in ok for gap in r.itl], percentiles),
        e2el=summarize([r.latency for r in ok], percentiles),
    )
