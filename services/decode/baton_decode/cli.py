"""``baton decode [MODEL]`` / ``baton prefill [MODEL]``: start one engine worker.

A decode worker prefills locally (aggregated mode) or pulls a prompt's KV from a prefill worker
(disaggregated); a prefill worker prefills prompts and holds their KV until it is pulled.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from baton import tracing
from baton_engine.arg_utils import add_engine_args, engine_kwargs_from_args
from baton_engine.config import EngineConfig
from baton_engine.errors import InvalidRequestError
from baton_engine.vllm_flags import METRIC_PREFIXES

DEFAULT_PORTS = {"decode": 50052, "prefill": 50053}


def add_parser(subparsers: Any) -> None:
    """Register ``decode`` on the ``baton`` command's subparsers."""
    add_worker_parser(subparsers, "decode")


def add_worker_parser(subparsers: Any, role: str) -> None:
    p = subparsers.add_parser(
        role,
        help=f"start a gRPC {role} worker",
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
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORTS[role], help="gRPC port (0: any free one)"
    )
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
    add_metric_names_argument(p)
    p.add_argument("--worker-id", default=None, help="id in the kvstore (None: role-address)")
    tracing.add_otlp_argument(p)
    p.add_argument(
        "--kvstore", default=None, help="kvstore address: register there and publish KV events"
    )
    p.add_argument(
        "--kv-transfer",
        choices=("auto", "nixl", "grpc"),
        default="auto",
        help="how KV blocks move between workers (auto: NIXL when it works, else gRPC)",
    )
    if role == "decode":
        p.add_argument(
            "--kv-load-failure-policy",
            choices=("recompute", "fail"),
            default="recompute",
            help="when pulling a prompt's KV fails: compute the prompt here, or fail the request",
        )
    else:
        p.add_argument(
            "--kv-lease-ms",
            type=int,
            default=30_000,
            help="how long a prefilled prompt's KV waits for its pull before it is freed",
        )
    add_engine_args(p)
    p.set_defaults(func=_cmd_worker, role=role)


def add_metric_names_argument(p: argparse.ArgumentParser) -> None:
    """``--metric-names``, the same on ``baton serve`` and the workers."""
    p.add_argument(
        "--metric-names",
        choices=METRIC_PREFIXES,
        default="baton",
        help="the engine metrics' prefix: baton:* or, as vLLM names them, vllm:* (so that "
        "dashboards and autoscalers built for vLLM read them unchanged)",
    )


def _cmd_worker(args: argparse.Namespace) -> int:
    from baton_decode.server import WorkerConfig, serve

    if args.max_pending is not None and args.max_pending < 1:
        raise InvalidRequestError("--max-pending must be at least 1")
    if args.shutdown_grace < 0:
        raise InvalidRequestError("--shutdown-grace must be non-negative")
    lease_ms = getattr(args, "kv_lease_ms", 30_000)
    if lease_ms < 1:
        raise InvalidRequestError("--kv-lease-ms must be at least 1")
    engine_config = EngineConfig(
        model=args.model, usage_context="serving", **engine_kwargs_from_args(args)
    )
    worker_config = WorkerConfig(
        role=args.role,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        served_model_name=args.served_model_name,
        max_pending=args.max_pending,
        shutdown_grace_s=args.shutdown_grace,
        log_stats_interval_s=math.inf if args.disable_log_stats else 5.0,
        metric_names=args.metric_names,
        worker_id=args.worker_id,
        kvstore_address=args.kvstore,
        kv_transfer=args.kv_transfer,
        kv_load_failure_policy=getattr(args, "kv_load_failure_policy", "recompute"),
        kv_lease_ms=lease_ms,
        otlp_endpoint=args.otlp_endpoint,
    )
    return serve(engine_config, worker_config)
