"""``baton decode [MODEL]``: start one decode worker (aggregated mode: it prefills locally)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from baton_engine.arg_utils import add_engine_args, engine_kwargs_from_args
from baton_engine.config import EngineConfig
from baton_engine.errors import InvalidRequestError

DEFAULT_PORT = 50052


def add_parser(subparsers: Any) -> None:
    """Register ``decode`` on the ``baton`` command's subparsers."""
    p = subparsers.add_parser(
        "decode",
        help="start a gRPC decode worker",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model path (None: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address for gRPC and metrics")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port (0: any free one)")
    p.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus HTTP port (0: any free one)"
    )
    p.add_argument("--served-model-name", default=None, help="model name in GetModelInfo/metrics")
    p.add_argument(
        "--max-pending",
        type=int,
        default=None,
        help="most requests in flight (running + waiting) before RESOURCE_EXHAUSTED "
        "(None: 4 * --max-num-seqs)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    p.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic engine stats log line"
    )
    add_engine_args(p)
    p.set_defaults(func=_cmd_decode)


def _cmd_decode(args: argparse.Namespace) -> int:
    from baton_decode.server import WorkerConfig, serve

    if args.max_pending is not None and args.max_pending < 1:
        raise InvalidRequestError("--max-pending must be at least 1")
    if args.shutdown_grace < 0:
        raise InvalidRequestError("--shutdown-grace must be non-negative")
    engine_config = EngineConfig(
        model=args.model, usage_context="serving", **engine_kwargs_from_args(args)
    )
    worker_config = WorkerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        served_model_name=args.served_model_name,
        max_pending=args.max_pending,
        shutdown_grace_s=args.shutdown_grace,
        log_stats_interval_s=math.inf if args.disable_log_stats else 5.0,
    )
    return serve(engine_config, worker_config)
