"""Goodput, disaggregated versus aggregated serving: long prompts at Poisson rates (issue 6).

    python benchmarks/serve_goodput.py [--modes nixl,aggregated+dec2] [--rates 1,2,4,8]
        [--input-len 4000] [--output-len 200] [--seconds-per-rate 8] [--min-requests 24]
        [--ttft-slo-ms 1000] [--tpot-slo-ms 50] [--also-tpot-slo-ms 10,20] [--attainment 0.9]
        [--model DIR]
        [--serve-args "--device cuda --gpus 0,1 --load-format dummy"] [--output-json PATH]

For each mode in turn (``serve_disagg_vs_agg.py``'s modes: ``nixl`` / ``grpc`` the disaggregated
stack, one prefill and one decode worker, with that KV transfer; ``aggregated+dec2`` two
aggregated replicas behind the gateway), this starts ``baton serve``, warms it up, and then runs
one load per rate, lowest first: ``max(--min-requests, rate x --seconds-per-rate)`` requests of
``--input-len`` random tokens and ``--output-len`` output tokens (``ignore_eos``), sent as a
Poisson process at that rate with no cap on requests in flight (``baton bench serve``'s load
generator, streamed ``/v1/completions``). Every load has prompts of its own (seeded, no shared
prefix), the same in every mode.

Per rate it reports TTFT and TPOT at p50 / p99, the output tokens/s, the KV pulled by the decode
workers (count, mean time, GB/s from ``baton:kv_transfer_*``), and the SLO attainment: the share
of the requests sent that succeeded with TTFT <= ``--ttft-slo-ms`` and TPOT <= ``--tpot-slo-ms``.
A mode's goodput is DistServe's: the highest rate tried whose attainment is at least
``--attainment`` (and every lower rate's too); ``--also-tpot-slo-ms`` reports it again for other
TPOT SLOs (same TTFT SLO) from the same requests. A mode stops at the first rate whose attainment
falls below ``--stop-below``: higher rates only queue more.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from serve_disagg_vs_agg import (
    MetricKey,
    decisions,
    kv_pull_stats,
    parse_mode,
    parse_modes,
    running_stack,
    scrape,
    write_summary,
)

from baton.bench.client import RequestConfig
from baton.bench.datasets import SampleRequest, load_bench_tokenizer, random_requests
from baton.bench.metrics import RequestResult, meets_slos, summarize
from baton.bench.runner import LoadShape, RunState, run_benchmark


@dataclass
class RatePoint:
    mode: str
    rate: float  # requests/s asked for
    requests: int
    failed: int
    duration_s: float  # first request sent to last one finished
    attainment: float  # share of the requests sent that met every SLO
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    output_tok_s: float
    kv_pulls: int
    kv_pull_mean_ms: float
    kv_read_mean_ms: float  # the bytes' movement alone
    kv_read_gbps: float  # bytes / read time, all pulls of the load together
    kv_bytes: float
    decisions: dict[str, int]  # the gateway's routing (remote or local prefill)
    also_attainment: dict[str, float]  # --also-tpot-slo-ms value -> attainment with it
    requests_ttft_tpot_ms: list[tuple[float, float | None]]  # per successful request


def num_requests(rate: float, args: argparse.Namespace) -> int:
    return max(args.min_requests, math.ceil(rate * args.seconds_per_rate))


def build_loads(args: argparse.Namespace) -> tuple[list[list[SampleRequest]], list[SampleRequest]]:
    """(one list of samples per rate, warm-up samples): every load draws its own prompts."""
    tokenizer = load_bench_tokenizer(args.model)
    loads = [
        random_requests(
            tokenizer, num_requests(rate, args), args.input_len, args.output_len, seed=1000 + i
        )
        for i, rate in enumerate(args.rates)
    ]
    warm = random_requests(tokenizer, 2, args.input_len, 8, seed=999)
    return loads, warm


async def _send(
    cfg: RequestConfig, samples: list[SampleRequest], rate: float, seed: int
) -> RunState:
    state = RunState(results=[None] * len(samples))
    shape = LoadShape(request_rate=rate, seed=seed, initial_test=False, show_progress=False)
    await run_benchmark(cfg, samples, shape, state)
    return state


def attainment(results: list[RequestResult], ttft_ms: float, tpot_ms: float) -> float:
    """The share of ``results`` that succeeded within both SLOs."""
    slos = {"ttft": ttft_ms, "tpot": tpot_ms}
    return sum(meets_slos(r, slos) for r in results) / len(results)


def measure(
    mode: str,
    rate: float,
    results: list[RequestResult],
    duration: float,
    delta: dict[MetricKey, float],
    roles: dict[str, str],
    args: argparse.Namespace,
) -> RatePoint:
    ok = [r for r in results if r.success]
    ttft = summarize([r.ttft for r in ok], (50.0, 99.0))
    tpot = summarize([t for r in ok if (t := r.tpot) is not None], (50.0, 99.0))
    kv = kv_pull_stats(delta, roles)
    count = int(kv["count"])
    return RatePoint(
        mode=mode,
        rate=rate,
        requests=len(results),
        failed=len(results) - len(ok),
        duration_s=duration,
        attainment=attainment(results, args.ttft_slo_ms, args.tpot_slo_ms),
        ttft_p50_ms=ttft.median,
        ttft_p99_ms=ttft.percentiles[99.0],
        tpot_p50_ms=tpot.median,
        tpot_p99_ms=tpot.percentiles[99.0],
        output_tok_s=sum(r.output_tokens for r in ok) / duration,
        kv_pulls=count,
        kv_pull_mean_ms=1000 * kv["seconds"] / count if count else 0.0,
        kv_read_mean_ms=1000 * kv["read_seconds"] / count if count else 0.0,
        kv_read_gbps=kv["bytes"] / kv["read_seconds"] / 1e9 if kv["read_seconds"] else 0.0,
        kv_bytes=kv["bytes"],
        decisions=decisions(delta),
        also_attainment={
            f"{t:g}": attainment(results, args.ttft_slo_ms, t) for t in args.also_tpot_slo_ms
        },
        requests_ttft_tpot_ms=[
            (r.ttft * 1000, None if r.tpot is None else r.tpot * 1000) for r in ok
        ],
    )


def print_point(p: RatePoint) -> None:
    kv = (
        f"KV {p.kv_pulls} pulls, {p.kv_pull_mean_ms:.1f} ms (read {p.kv_read_mean_ms:.1f} ms, "
        f"{p.kv_read_gbps:.1f} GB/s)"
        if p.kv_pulls
        else "KV -"
    )
    print(
        f"  {p.mode:<16} {p.rate:6.2f} req/s x {p.requests:3d}: attainment {p.attainment:5.1%}, "
        f"TTFT p50/p99 {p.ttft_p50_ms:6.0f} / {p.ttft_p99_ms:6.0f} ms, TPOT p50/p99 "
        f"{p.tpot_p50_ms:5.1f} / {p.tpot_p99_ms:5.1f} ms, {p.output_tok_s:7.0f} tok/s, "
        f"failed {p.failed}; {kv}; decisions {p.decisions or '-'}",
        flush=True,
    )


def run_mode(
    mode: str,
    args: argparse.Namespace,
    loads: list[list[SampleRequest]],
    warm: list[SampleRequest],
    log_dir: Path,
) -> list[RatePoint]:
    points: list[RatePoint] = []

    def warm_up(cfg: RequestConfig) -> RunState:
        return asyncio.run(_send(cfg, warm, float("inf"), 0))

    with running_stack(mode, args, log_dir, warm_up, args.request_timeout) as (base, cfg, roles):
        for i, (rate, samples) in enumerate(zip(args.rates, loads, strict=True)):
            _, before = scrape(base)
            state = asyncio.run(_send(cfg, samples, rate, seed=i))
            _, after = scrape(base)
            assert state.start is not None and state.end is not None
            results = [r for r in state.results if r is not None]
            delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
            point = measure(mode, rate, results, state.end - state.start, delta, roles, args)
            print_point(point)
            points.append(point)
            if point.attainment < args.stop_below:
                break
    return points


def goodput(points: list[RatePoint], target: float, tpot_slo: str | None = None) -> float:
    """The highest rate whose attainment (and every lower rate's) is at least ``target``; with
    ``tpot_slo``, the attainment under that ``--also-tpot-slo-ms`` value."""
    best = 0.0
    for p in sorted(points, key=lambda p: p.rate):
        got = p.attainment if tpot_slo is None else p.also_attainment[tpot_slo]
        if got < target:
            break
        best = p.rate
    return best


def report(points: list[RatePoint], modes: list[str], args: argparse.Namespace) -> dict[str, Any]:
    print()
    print(
        f"{args.input_len}-token prompts, {args.output_len} output tokens (ignore_eos), Poisson "
        f"arrivals; SLOs TTFT <= {args.ttft_slo_ms:.0f} ms and TPOT <= {args.tpot_slo_ms:.0f} ms; "
        f"goodput = highest rate with >= {args.attainment:.0%} of requests meeting both."
    )
    head = (
        f"{'mode':<16} {'rate':>5} {'req':>4} {'attain':>7} | {'TTFT p50':>8} {'p99':>6} | "
        f"{'TPOT p50':>8} {'p99':>6} | {'tok/s':>7} | {'KV pull':>7} {'read':>6} {'GB/s':>6}"
    )
    print(head + "   (ms)")
    print("-" * len(head))
    for p in points:
        print(
            f"{p.mode:<16} {p.rate:5.2f} {p.requests:4d} {p.attainment:7.1%} | "
            f"{p.ttft_p50_ms:8.0f} {p.ttft_p99_ms:6.0f} | {p.tpot_p50_ms:8.1f} "
            f"{p.tpot_p99_ms:6.1f} | {p.output_tok_s:7.0f} | {p.kv_pull_mean_ms:7.1f} "
            f"{p.kv_read_mean_ms:6.1f} {p.kv_read_gbps:6.1f}"
        )
    summary: dict[str, Any] = {"points": [asdict(p) for p in points], "goodput": {}}
    print()
    for mode in modes:
        g = goodput([p for p in points if p.mode == mode], args.attainment)
        summary["goodput"][mode] = g
        print(f"goodput {mode:<16} {g:6.2f} req/s")
    summary["also_goodput"] = {}
    for t in args.also_tpot_slo_ms:
        key = f"{t:g}"
        print(f"with TPOT <= {key} ms instead:")
        for mode in modes:
            g = goodput([p for p in points if p.mode == mode], args.attainment, key)
            summary["also_goodput"].setdefault(key, {})[mode] = g
            print(f"  goodput {mode:<16} {g:6.2f} req/s")
    agg = [m for m in modes if parse_mode(m).base == "aggregated"]
    for mode in modes:
        if parse_mode(mode).base == "aggregated" or not agg:
            continue
        ref = summary["goodput"][agg[0]]
        if ref:
            ratio = summary["goodput"][mode] / ref
            print(f"  {mode} / {agg[0]}: {ratio:.2f}x")
    return summary


def parse_rates(text: str) -> list[float]:
    rates = sorted(float(x) for x in text.split(",") if x.strip())
    if not rates or rates[0] <= 0:
        raise argparse.ArgumentTypeError("rates are positive requests/s, e.g. 1,2,4")
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default="nixl,aggregated+dec2", help="as serve_disagg_vs_agg.py")
    p.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,4,8"), help="req/s")
    p.add_argument("--model", default=None, help="model for baton serve (default: its default)")
    p.add_argument("--serve-args", default="", help="more arguments for every baton serve")
    p.add_argument("--input-len", type=int, default=4000)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--seconds-per-rate", type=float, default=8.0)
    p.add_argument("--min-requests", type=int, default=24)
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=50.0)
    p.add_argument(
        "--also-tpot-slo-ms",
        type=lambda text: [float(x) for x in text.split(",") if x.strip()],
        default=[],
        help="other TPOT SLOs to report goodput for, e.g. 10,20",
    )
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--stop-below", type=float, default=0.5, help="attainment that ends a mode")
    p.add_argument("--remote-prefill-threshold", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=None, help="keep serve logs here")
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args()
    modes = parse_modes(p, args.modes)
    loads, warm = build_loads(args)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    points: list[RatePoint] = []
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for mode in modes:
            points += run_mode(mode, args, loads, warm, log_dir)
    summary = report(points, modes, args)
    write_summary(summary, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
