"""``baton bench``: measure the engine (``throughput``, ``latency``) or a server (``serve``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_bench_parser(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)

    from baton.bench import throughput

    tp = kinds.add_parser("throughput", help="offline throughput of the engine (vs HF)")
    throughput.add_args(tp)
    add_engine_args(tp)
    tp.set_defaults(func=throughput.main)


def run_bench(args: argparse.Namespace) -> int:
    return int(args.func(args))
