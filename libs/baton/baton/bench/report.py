"""Reporting a serving benchmark: the printed table, the JSON result and the latency-CDF plot.

The table and the JSON keys follow vLLM's ``bench serve`` (``mean_ttft_ms``, ``p99_itl_ms``,
``ttfts`` in seconds, ...), so scripts written for vLLM's results read Baton's too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from baton.bench.metrics import BenchmarkMetrics, LatencyStats, RequestResult

_WIDTH = 50
_SECTIONS = (  # (metric key, its title, its row label)
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def _pct_label(p: float) -> str:
    return f"{p:g}".replace(".", "_")  # 99.9 -> "99_9" in JSON keys, as vLLM does


def format_table(m: BenchmarkMetrics, max_concurrency: int | None, request_rate: float) -> str:
    """The result table, vLLM-style (``{label:<40} {value:<10}`` rows under ``=`` and ``-``
    headings)."""
    lines = [f"{' Serving Benchmark Result ':=^{_WIDTH}}"]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Request rate (req/s):", "inf" if request_rate == float("inf") else request_rate)
    row("Benchmark duration (s):", m.duration, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")
    for key, title, label in _SECTIONS:
        stats: LatencyStats = getattr(m, key)
        lines.append(f"{title:-^{_WIDTH}}")
        row(f"Mean {label} (ms):", stats.mean, ".2f")
        row(f"Median {label} (ms):", stats.median, ".2f")
        for p, value in stats.percentiles.items():
            row(f"P{p:g} {label} (ms):", value, ".2f")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def result_json(
    m: BenchmarkMetrics, results: Sequence[RequestResult], extra: dict[str, Any]
) -> dict[str, Any]:
    """All figures (vLLM's keys; latencies in ms) plus per-request arrays in request order
    (``ttfts``, ``tpots``, ``e2els`` in seconds, ``itls`` a list per request; failed requests
    have zeros and their error) merged over ``extra`` (arguments, date, ...)."""
    out: dict[str, Any] = dict(extra)
    out.update(
        completed=m.completed,
        failed=m.failed,
        duration=m.duration,
        total_input_tokens=m.total_input,
        total_output_tokens=m.total_output,
        request_throughput=m.request_throughput,
        request_goodput=m.request_goodput,
        output_throughput=m.output_throughput,
        total_token_throughput=m.total_token_throughput,
    )
    for key, _, _ in _SECTIONS:
        stats: LatencyStats = getattr(m, key)
        out[f"mean_{key}_ms"] = stats.mean
        out[f"median_{key}_ms"] = stats.median
        out[f"std_{key}_ms"] = stats.std
        for p, value in stats.percentiles.items():
            out[f"p{_pct_label(p)}_{key}_ms"] = value
    t0 = min((r.start for r in results), default=0.0)
    out.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_tokens for r in results],
        successes=[r.success for r in results],
        start_times=[r.start - t0 for r in results],
        ttfts=[r.ttft for r in results],
        tpots=[r.tpot or 0.0 for r in results],
        itls=[r.itl for r in results],
        e2els=[r.latency for r in results],
        errors=[r.error for r in results],
        generated_texts=[r.generated_text for r in results],
    )
    return out


def plot_cdf(results: Sequence[RequestResult], path: Path, title: str) -> None:
    """Save the CDFs of TTFT, TPOT and ITL, and E2E latency of the successful requests (ms) as
    a PNG with matplotlib's Agg backend (no display needed). Creates the parent folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.success]
    panels: list[tuple[str, list[tuple[str, list[float]]]]] = [
        ("TTFT", [("TTFT", [r.ttft for r in ok])]),
        (
            "TPOT and ITL",
            [
                ("TPOT", [t for r in ok if (t := r.tpot) is not None]),
                ("ITL", [gap for r in ok for gap in r.itl]),
            ],
        ),
        ("End-to-end latency", [("E2E", [r.latency for r in ok])]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.5))
    try:
        for ax, (name, series) in zip(axes, panels, strict=True):
            for label, values_s in series:
                if not values_s:
                    continue
                xs = np.sort(np.asarray(values_s) * 1000.0)
                ys = np.arange(1, len(xs) + 1) / len(xs)
                ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
            ax.set_title(name)
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of samples")
            ax.set_ylim(0.0, 1.0)
            ax.grid(True, alpha=0.3)
            if ax.get_lines():
                ax.legend(loc="lower right")
        fig.suptitle(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
