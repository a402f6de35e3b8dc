"""``baton serve [MODEL]``: a whole Baton stack on this machine, one OS process per service.

Aggregated mode runs ``baton decode`` (the engine; it prefills locally) and ``baton gateway``
(the OpenAI HTTP server), each as the same command a container would run, so ``ps`` shows which
is which. The model is resolved (a GGUF converted) once here, so both children find the cache.

Lifecycle: both children start at once (the gateway waits for the worker); once both printed
their ready lines, this prints where it serves and forwards their output. Ctrl-C or SIGTERM
stops the gateway, then the worker (SIGTERM, a grace period, then SIGKILL; a second signal kills
at once). A child that dies unexpectedly stops the others and makes this exit non-zero. Each
child runs in its own session (so a terminal's Ctrl-C reaches only this process, which stops them
in order) and gets SIGTERM from the kernel if this process dies without cleaning up.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

_READY = {"decode": "baton decode ready on ", "gateway": "baton gateway ready on "}
_STOP_GRACE_S = 10.0  # per child, after SIGTERM, before SIGKILL
_PR_SET_PDEATHSIG = 1


def add_parser(subparsers: Any) -> None:
    """Register ``serve`` on the ``baton`` command's subparsers."""
    from baton_engine.arg_utils import add_engine_args

    p = subparsers.add_parser(
        "serve",
        help="serve a model over the OpenAI API (gateway + decode worker)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="model path (default: SmolLM2)")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP server listens on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id for clients (default: the default model's name, or the folder/file stem)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("BATON_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $BATON_API_KEY)",
    )
    p.add_argument("--mode", choices=("aggregated", "disaggregated"), default="aggregated")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds the services get to start before this gives up",
    )
    p.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no access log line per request"
    )
    add_engine_args(p)
    p.set_defaults(func=_cmd_serve)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` that differ from the engine's defaults, as command-line
    arguments for ``baton decode`` (so its own defaults stay the single source of truth)."""
    from dataclasses import fields

    from baton_engine.arg_utils import engine_kwargs_from_args
    from baton_engine.config import EngineConfig

    defaults = {f.name: getattr(EngineConfig(), f.name) for f in fields(EngineConfig)}
    argv: list[str] = []
    for name, value in engine_kwargs_from_args(args).items():
        if value is None or value == defaults.get(name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM me when my parent dies (Linux; a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class Child:
    """One service process and the thread forwarding its output."""

    name: str  # "decode" | "gateway"
    proc: subprocess.Popen[str]
    ready: threading.Event = field(default_factory=threading.Event)
    ready_line: str = ""
    forwarder: threading.Thread | None = None

    def forward(self, out: IO[str]) -> None:
        assert self.proc.stdout is not None
        marker = _READY[self.name]
        for line in self.proc.stdout:
            if not self.ready.is_set() and line.startswith(marker):
                self.ready_line = line.strip()
                self.ready.set()
            out.write(f"({self.name}) {line}")
            out.flush()


def start_child(name: str, argv: Sequence[str], env: dict[str, str]) -> Child:
    """Start ``python -m baton.cli NAME ...`` in its own session, output piped for forwarding."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", name, *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    return Child(name, proc)


def stop_children(children: Sequence[Child], force: threading.Event) -> None:
    """Stop ``children`` in order: SIGTERM to its process group, up to ``_STOP_GRACE_S`` (less
    once ``force`` is set), then SIGKILL. Returns when every one has exited."""
    for child in children:
        if child.proc.poll() is None:
            _signal_group(child.proc, signal.SIGTERM)
            deadline = time.monotonic() + _STOP_GRACE_S
            while child.proc.poll() is None and time.monotonic() < deadline:
                if force.wait(0.05):
                    break
        if child.proc.poll() is None:
            _signal_group(child.proc, signal.SIGKILL)
        child.proc.wait()
        # Whatever the service left in its group (it has none of its own by design) goes too.
        _signal_group(child.proc, signal.SIGKILL)
    for child in children:
        if child.forwarder is not None:
            child.forwarder.join(timeout=2.0)


def _signal_group(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the child leads its own group (start_new_session)


def _cmd_serve(args: argparse.Namespace) -> int:
    from baton_engine.errors import InvalidRequestError
    from baton_engine.model_files import resolve_model, served_model_name

    if args.mode != "aggregated":
        raise InvalidRequestError("--mode disaggregated is not built yet; use --mode aggregated")
    resolve_model(args.model)  # convert once, before two processes race to
    name = args.served_model_name or served_model_name(args.model)
    model_argv = [] if args.model is None else [args.model]
    decode_addr = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.api_key:
        env["BATON_API_KEY"] = args.api_key  # not on the command line, where ps shows it
    else:
        env.pop("BATON_API_KEY", None)
    decode_argv = [
        *model_argv,
        *("--host", "127.0.0.1", "--port", decode_addr.rsplit(":", 1)[1], "--metrics-port", "0"),
        *("--served-model-name", name),
        *engine_argv(args),
    ]
    gateway_argv = [
        *("--host", args.host, "--port", str(args.port), "--decode-addr", decode_addr),
        *("--served-model-name", name, "--connect-timeout", str(args.ready_timeout)),
        *(["--model", args.model] if args.model is not None else []),
        *(["--disable-uvicorn-access-log"] if args.disable_uvicorn_access_log else []),
    ]

    stop, force = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        (force if stop.is_set() else stop).set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    try:
        # Both children are started before any thread exists here (preexec_fn and threads do
        # not mix); the gateway waits for the worker to answer.
        children = [
            start_child("decode", decode_argv, env),
            start_child("gateway", gateway_argv, env),
        ]
        for child in children:
            child.forwarder = threading.Thread(
                target=child.forward, args=(sys.stdout,), name=f"{child.name}-output", daemon=True
            )
            child.forwarder.start()
        return _supervise(children, name, args, stop)
    finally:
        stop_children(list(reversed(children)), force)  # the gateway first, then the worker
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(
    children: list[Child], name: str, args: argparse.Namespace, stop: threading.Event
) -> int:
    """Wait for the ready lines, then for a signal or a child's death; the exit status."""
    deadline = time.monotonic() + args.ready_timeout
    announced = False
    while not stop.wait(0.1):
        for child in children:
            code = child.proc.poll()
            if code is not None:
                when = "unexpectedly" if announced else "before it was ready"
                print(
                    f"error: baton {child.name} exited {when} with status {code} "
                    "(its output is above); stopping",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        if not announced and all(c.ready.is_set() for c in children):
            url = f"http://{args.host}:{args.port}/v1"
            print(f"Baton is serving {name} at {url}", flush=True)
            announced = True
        elif not announced and time.monotonic() > deadline:
            late = [c.name for c in children if not c.ready.is_set()]
            print(
                f"error: baton {', '.join(late)} not ready after {args.ready_timeout:.0f} s; "
                "stopping",
                file=sys.stderr,
                flush=True,
            )
            return 1
    print("Baton: stopping", file=sys.stderr, flush=True)
    return 0
