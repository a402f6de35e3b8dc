"""``baton bench``: measure the engine (``throughput``, ``latency``) or a server (``serve``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_bench_parser(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)

    from baton.bench import latency, serve, throughput

    tp = kinds.add_parser("throughput", help="offline throughput of the engine (vs HF)")
    throughput.add_args(tp)
    add_engine_args(tp)
    tp.set_defaults(func=throughput.main)

    lat = kinds.add_parser(
        "latency",
        help="prefill and per-token decode time of one request at a time (offline engine)",
        description=latency.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    latency.add_args(lat)
    add_engine_args(lat)
    lat.set_defaults(func=latency.main)

    srv = kinds.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (TTFT, ITL, TPOT, throughput, goodput)",
        description=serve.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_args(srv)
    srv.set_defaults(func=serve.main)


def run_bench(args: argparse.Namespace) -> int:
    return int(args.func(args))
