"""``baton kvstore``: the worker directory and global prefix index, over gRPC.

State lives in Redis with ``--redis-url``, else in this process's memory (lost when it stops).
``python -m baton_kvstore.cli`` runs it without the rest of the ``baton`` command.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

DEFAULT_PORT = 50060


def add_parser(subparsers: Any) -> None:
    """Register ``kvstore`` on the ``baton`` command's subparsers."""
    p = subparsers.add_parser(
        "kvstore",
        help="start the kvstore (worker directory and prefix index)",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run_kvstore)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address for gRPC and metrics")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port (0: any free one)")
    p.add_argument(
        "--redis-url", default=None, help="redis://HOST:PORT/DB to keep state in (None: memory)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus HTTP port (0: any free one; None: no metrics endpoint)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level of the kvstore's own loggers",
    )


def run_kvstore(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; return 0. Prints ``baton kvstore ready on HOST:PORT (...)``."""
    from baton_kvstore.server import KVStoreConfig, serve

    logging.getLogger("baton_kvstore").setLevel(args.log_level.upper())
    config = KVStoreConfig(
        host=args.host, port=args.port, redis_url=args.redis_url, metrics_port=args.metrics_port
    )
    return serve(config)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m baton_kvstore.cli [kvstore] ARGS``: the kvstore alone, without ``baton``."""
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format)
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["kvstore"]:
        args_list = args_list[1:]
    parser = argparse.ArgumentParser(prog="baton kvstore", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(args_list)
    from baton_engine.errors import BatonError

    try:
        return run_kvstore(args)
    except BatonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
