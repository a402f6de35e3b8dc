"""``baton serve [MODEL]``: a whole Baton stack on this machine, one OS process per service.

Disaggregated mode (the default) runs ``baton kvstore`` (worker directory and prefix index),
``--num-prefill`` ``baton prefill`` and ``--num-decode`` ``baton decode`` workers, and
``baton gateway`` (the OpenAI HTTP server); aggregated mode runs only decode workers (they
prefill locally) and the gateway. Each is the same command a container would run, so ``ps``
shows which is which. The model is resolved (a GGUF converted) once here, so every child finds
the cache.

Lifecycle: all children start at once (the gateway waits for the workers); once all printed
their ready lines, this prints where it serves and forwards their output. Ctrl-C or SIGTERM
stops the gateway, then the workers, then the kvstore (SIGTERM, a grace period, then SIGKILL; a
second signal kills at once). Once serving, a worker or the kvstore that dies is reported and
restarted (up to three times each) while the rest keep serving; the gateway dying, or any child
dying before the stack is ready, stops everything with a non-zero exit. Each child runs in its
own session (so a terminal's Ctrl-C reaches only this process, which stops them in order) and
gets SIGTERM from the kernel if this process dies without cleaning up (restarted children
excepted: they are started from a threaded process, where that hook is unsafe).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from baton import tracing

_READY = {kind: f"baton {kind} ready on " for kind in ("kvstore", "prefill", "decode", "gateway")}
_STOP_GRACE_S = 10.0  # per child, after SIGTERM, before SIGKILL
_PR_SET_PDEATHSIG = 1


def add_parser(subparsers: Any) -> None:
    """Register ``serve`` on the ``baton`` command's subparsers."""
    from baton_decode.cli import add_metric_names_argument
    from baton_engine.arg_utils import add_engine_args
    from baton_gateway.cli import add_frontend_arguments

    p = subparsers.add_parser(
        "serve",
        help="serve a model over the OpenAI API (gateway + decode worker)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="model path (default: SmolLM2)")
    p.add_argument(
        "--model",
        dest="model_option",
        default=None,
        help="the model path, as vLLM's older spelling (instead of the positional argument)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP server listens on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model id for clients (default: the default model's name, or the folder/file "
        "stem); with several, requests may name any, responses and metrics use the first",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("BATON_API_KEY") or os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $BATON_API_KEY, else vLLM's "
        "$VLLM_API_KEY)",
    )
    p.add_argument(
        "--mode",
        choices=("aggregated", "disaggregated"),
        default=None,
        help="disaggregated (the default): kvstore + prefill and decode workers; aggregated: "
        "decode workers that prefill locally (the default with --tensor-parallel-size > 1, "
        "which disaggregation would need twice the GPUs for)",
    )
    p.add_argument("--num-prefill", type=int, default=1, help="prefill workers (disaggregated)")
    p.add_argument("--num-decode", type=int, default=1, help="decode workers")
    p.add_argument(
        "--redis-url", default=None, help="the kvstore's Redis (default: its in-memory store)"
    )
    p.add_argument(
        "--kv-transfer",
        choices=("auto", "nixl", "grpc"),
        default="auto",
        help="how KV moves from prefill to decode workers (auto: NIXL when it works, else gRPC)",
    )
    p.add_argument(
        "--remote-prefill-threshold",
        type=int,
        default=256,
        help="prompt tokens not cached on the chosen decode worker above which the prompt is "
        "prefilled on a prefill worker (else locally)",
    )
    p.add_argument(
        "--max-remote-prefill-wait-ms",
        type=float,
        default=None,
        help="prefill a prompt on its decode worker instead when the prefill workers' queue "
        "would keep it waiting longer than this and the decode worker has less prefill queued "
        "(default: always on a prefill worker)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        choices=("recompute", "fail"),
        default="recompute",
        help="when a decode worker cannot pull a prompt's KV",
    )
    p.add_argument(
        "--gpus",
        default=None,
        help="with --device cuda: GPU ids the workers are pinned to, one each in turn "
        "(prefill workers first), e.g. 0,1 (default: $CUDA_VISIBLE_DEVICES)",
    )
    tracing.add_otlp_argument(p)  # passed on to every service
    p.add_argument(
        "--prefill-tensor-parallel-size",
        type=int,
        default=None,
        help="ranks of each prefill worker (default: --tensor-parallel-size); KV moves as "
        "whole blocks, so it need not match the decode workers'",
    )
    p.add_argument(
        "--kv-lease-ms",
        type=int,
        default=30_000,
        help="how long a prefilled prompt's KV waits for its pull",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds the services get to start before this gives up",
    )
    p.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no access log line per request"
    )
    p.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic stats log line per worker"
    )
    add_metric_names_argument(p)
    add_frontend_arguments(p)
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
    for name, value in engine_kwargs_from_args(args, check=False).items():
        if value is None or value == defaults.get(name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, tuple):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_picker(avoid: int) -> Callable[[], int]:
    """Free loopback ports for the stack's services, none twice and never ``avoid`` (the
    gateway's, which is bound only once the workers are up). A port ``free_port`` found is
    free again once it returns, so the next call can find it again: the user's ``--port``,
    picked the same way and released, came back as a worker's."""
    taken = {avoid}

    def pick() -> int:
        for _ in range(1000):
            port = free_port()
            if port not in taken:
                taken.add(port)
                return port
        raise RuntimeError("no free loopback port found for the stack's services")

    return pick


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

    kind: str  # "kvstore" | "prefill" | "decode" | "gateway"
    label: str  # "decode", or "decode-1" when there are several
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[str]
    ready: threading.Event = field(default_factory=threading.Event)
    ready_line: str = ""
    forwarder: threading.Thread | None = None

    def forward(self, out: IO[str]) -> None:
        assert self.proc.stdout is not None
        marker = _READY[self.kind]
        for line in self.proc.stdout:
            if not self.ready.is_set() and line.startswith(marker):
                self.ready_line = line.strip()
                self.ready.set()
            out.write(f"({self.label}) {line}")
            out.flush()

    def start_forwarding(self, out: IO[str]) -> None:
        self.forwarder = threading.Thread(
            target=self.forward, args=(out,), name=f"{self.label}-output", daemon=True
        )
        self.forwarder.start()


def start_child(
    kind: str, label: str, argv: Sequence[str], env: dict[str, str], preexec: bool = True
) -> Child:
    """Start ``python -m baton.cli KIND ...`` in its own session, output piped for forwarding."""
    use_preexec = preexec and sys.platform == "linux"
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", kind, *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent if use_preexec else None,
    )
    return Child(kind, label, list(argv), env, proc)


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
    from baton_engine.arg_utils import engine_kwargs_from_args
    from baton_engine.config import EngineConfig
    from baton_engine.errors import InvalidRequestError
    from baton_engine.model_files import resolve_model, served_model_name
    from baton_engine.vllm_flags import ENGINE_FLAGS, FRONTEND_FLAGS, check_flags
    from baton_gateway.cli import check_tls, load_chat_template, tool_call_parser
    from baton_gateway.server import load_middleware

    if args.model_option is not None:
        if args.model is not None and args.model != args.model_option:
            raise InvalidRequestError(
                f"two models: {args.model} and --model {args.model_option} (give one)"
            )
        args.model = args.model_option
    resolve_mode(args)  # (--data-parallel-size counts the decode workers)
    if args.num_decode < 1 or args.num_prefill < 0:
        raise InvalidRequestError("--num-decode must be at least 1 and --num-prefill at least 0")
    if _prefill_tp(args) < 1:
        raise InvalidRequestError("--prefill-tensor-parallel-size must be at least 1")
    # The gateway's options, checked before anything starts.
    tool_call_parser(args)
    load_chat_template(args.chat_template)
    check_tls(args)
    for middleware in args.middleware:
        load_middleware(middleware)
    check_flags(vars(args), FRONTEND_FLAGS + ENGINE_FLAGS)
    EngineConfig(**engine_kwargs_from_args(args, check=False)).validate()  # (the workers')
    resolve_model(args.model)  # convert once, before several processes race to
    draft = _draft_model(args)
    if draft is not None:  # (the draft's too: a path that is not there stops serve here)
        resolve_model(draft)
    name = args.served_model_name[0] if args.served_model_name else served_model_name(args.model)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # NIXL/UCX between processes of this machine: the loopback device only.
    env.setdefault("UCX_NET_DEVICES", "lo")
    if args.api_key:
        env["BATON_API_KEY"] = args.api_key  # not on the command line, where ps shows it
    else:
        env.pop("BATON_API_KEY", None)
        env.pop("VLLM_API_KEY", None)
    plan = _plan(args, name)

    stop, force = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        (force if stop.is_set() else stop).set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    try:
        # Every child is started before any thread exists here (preexec_fn and threads do not
        # mix); the gateway waits for the workers to answer, the workers for the kvstore.
        gpus, counts = _gpu_ids(args), _gpu_counts(args, plan)
        for note in share_gpu_memory(args, plan, gpus):
            print(f"GPU memory: {note} of each GPU's memory", flush=True)
        workers = [label for kind, label, _ in plan if kind in ("prefill", "decode")]
        children = [
            start_child(
                kind,
                label,
                argv,
                {**env, **_gpu_env(gpus, workers, label, counts), **_cpu_env(args, workers, label)},
            )
            for kind, label, argv in plan
        ]
        for child in children:
            child.start_forwarding(sys.stdout)
        return _supervise(children, name, args, stop)
    finally:
        # The gateway first, then the workers, then the kvstore.
        stop_children(sorted(children, key=lambda c: _STOP_ORDER[c.kind]), force)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_STOP_ORDER = {"gateway": 0, "prefill": 1, "decode": 1, "kvstore": 2}
# Every process on a multi-GPU host: NVLink multicast off (it is not available to these jobs);
# NIXL READs between GPUs over CUDA IPC instead of a silent TCP fallback (FACTS.md).
_GPU_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
}


# CPU workers that share the host's cores: torch's OpenMP threads (libgomp) spin
# GOMP_SPINCOUNT iterations (300,000 by default) after each parallel region before they
# sleep, so while a prefill and a decode worker are both busy, one's spinning threads hold the
# cores the other's threads wait for (under load, a mean ITL of 180-390 ms against 29). A thousand
# keeps most of a lone worker's speed and ends the stall: on two cores, 34 requests at
# concurrency 8 through a prefill and a decode worker took 6.3 s instead of 18.8-32.7 s, a lone
# request's ITL 12.9-15.2 against 10.1-14.1 ms (OMP_WAIT_POLICY=PASSIVE: 6.0 s but 18 ms; one
# thread a worker: 7.2 s, a lone prefill twice as long; benchmarks/RESULTS.md, fiftieth
# session).
SHARED_CPU_ENV = {"GOMP_SPINCOUNT": "1000"}


def _cpu_env(args: argparse.Namespace, workers: list[str], label: str) -> dict[str, str]:
    """Worker ``label``'s OpenMP settings on CPU: ``SHARED_CPU_ENV`` where several workers
    share the cores, unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set (the user's choice)."""
    if str(args.device).startswith("cuda") or label not in workers or len(workers) < 2:
        return {}
    if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
        return {}
    return dict(SHARED_CPU_ENV)


def _gpu_ids(args: argparse.Namespace) -> list[str]:
    """The GPUs the workers are spread over (``--gpus``, else $CUDA_VISIBLE_DEVICES); none on
    CPU."""
    if not str(args.device).startswith("cuda"):
        return []
    listed = args.gpus or os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [g.strip() for g in listed.split(",") if g.strip()]


def resolve_mode(args: argparse.Namespace) -> None:
    """Fill in ``args.mode``: disaggregated, but aggregated with tensor parallelism: ``-tp N``
    on N GPUs is the common case, and a prefill plus a decode worker of N ranks each would
    share them. ``--mode disaggregated`` then splits prefill workers
    ``--prefill-tensor-parallel-size`` ways (default N) and decode workers N ways. Aggregated
    too with vLLM's ``--data-parallel-size N``: N engines, each a whole replica, behind the
    one API server, which here are N decode workers (``--num-decode N``) prefilling their own
    prompts."""
    from baton_engine.errors import InvalidRequestError

    dp = getattr(args, "data_parallel_size", None) or 1
    if dp > 1:
        if args.num_decode not in (1, dp):
            raise InvalidRequestError(
                f"--data-parallel-size {dp} and --num-decode {args.num_decode}: both count "
                "the decode workers (give one)"
            )
        args.num_decode, args.data_parallel_size = dp, 1
        if args.mode is None:
            args.mode = "aggregated"
    if args.mode is None:
        tp = getattr(args, "tensor_parallel_size", 1) > 1
        args.mode = "aggregated" if tp else "disaggregated"


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` less ``flag`` and its value."""
    if flag not in argv:
        return argv
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :]


def _draft_model(args: argparse.Namespace) -> str | None:
    """The draft model ``--speculative-config`` names, if any (serve resolves its path before
    any worker starts)."""
    from baton_engine.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(getattr(args, "speculative_config", None))
    return spec.model if spec is not None else None


def _gpu_counts(args: argparse.Namespace, plan: list[tuple[str, str, list[str]]]) -> list[int]:
    """GPUs of each worker of ``plan``, in order: one per rank."""
    tp = getattr(args, "tensor_parallel_size", 1)
    ptp = _prefill_tp(args)
    return [tp if kind == "decode" else ptp for kind, _, _ in plan if kind in ("prefill", "decode")]


def _prefill_tp(args: argparse.Namespace) -> int:
    ptp = getattr(args, "prefill_tensor_parallel_size", None)
    return int(getattr(args, "tensor_parallel_size", 1) if ptp is None else ptp)


def _worker_gpus(gpus: list[str], counts: list[int]) -> list[list[str]]:
    """Each worker's GPUs: ``counts[i]`` for worker ``i`` (workers in plan order), round robin
    over ``gpus``."""
    out, first = [], 0
    for n in counts:
        out.append([gpus[(first + k) % len(gpus)] for k in range(n)])
        first += n
    return out


def _gpu_env(gpus: list[str], workers: list[str], label: str, counts: list[int]) -> dict[str, str]:
    """Worker ``label``'s own GPUs (``_worker_gpus``) as its environment."""
    if not gpus or label not in workers:
        return {}
    mine = _worker_gpus(gpus, counts)[workers.index(label)]
    return {**_GPU_ENV, "CUDA_VISIBLE_DEVICES": ",".join(mine)}


def _gpu_shares(gpus: list[str], counts: list[int]) -> list[int]:
    """For each worker, how many workers use its most shared GPU (1: it has its GPUs alone)."""
    placed = _worker_gpus(gpus, counts)
    users = collections.Counter(g for mine in placed for g in set(mine))
    return [max((users[g] for g in mine), default=1) for mine in placed]


def share_gpu_memory(
    args: argparse.Namespace, plan: list[tuple[str, str, list[str]]], gpus: list[str]
) -> list[str]:
    """Workers that share a GPU split ``--gpu-memory-utilization`` between them (each
    engine's share counts the device's total memory, as in vLLM): the argv of such a worker
    gets its part. Nothing changes when the KV pool's size is given outright. Returns a line
    per worker that shares, for the log."""
    if not gpus or args.num_gpu_blocks_override is not None or args.kv_cache_memory is not None:
        return []
    workers = [(label, argv) for kind, label, argv in plan if kind in ("prefill", "decode")]
    notes = []
    shares = _gpu_shares(gpus, _gpu_counts(args, plan))
    for (label, argv), share in zip(workers, shares, strict=True):
        if share > 1:
            part = args.gpu_memory_utilization / share
            argv += ["--gpu-memory-utilization", f"{part:.4g}"]
            notes.append(f"{label} shares its GPUs with {share - 1} other worker(s): {part:.4g}")
    return notes


def _plan(args: argparse.Namespace, name: str) -> list[tuple[str, str, list[str]]]:
    """(kind, label, argv) of every child: the command lines a container would run."""
    resolve_mode(args)
    model_argv = [] if args.model is None else [args.model]
    disaggregated = args.mode == "disaggregated"
    num_prefill = args.num_prefill if disaggregated else 0
    plan: list[tuple[str, str, list[str]]] = []
    kvstore_argv: list[str] = []
    otlp_argv = ["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []
    port = _port_picker(args.port)
    if disaggregated:
        kvstore_addr = f"127.0.0.1:{port()}"
        kvstore_argv = ["--kvstore", kvstore_addr]
        argv = ["--host", "127.0.0.1", "--port", kvstore_addr.rsplit(":", 1)[1]]
        if args.redis_url:
            argv += ["--redis-url", args.redis_url]
        plan.append(("kvstore", "kvstore", argv))
    addrs: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, count in (("prefill", num_prefill), ("decode", args.num_decode)):
        for i in range(count):
            addr = f"127.0.0.1:{port()}"
            addrs[role].append(addr)
            metrics = str(port())
            argv = [
                *model_argv,
                *("--host", "127.0.0.1", "--port", addr.rsplit(":", 1)[1]),
                *("--metrics-port", metrics),
                *("--served-model-name", name, "--worker-id", f"{role}-{i}"),
                *kvstore_argv,
                *otlp_argv,
                *("--kv-transfer", args.kv_transfer),
                *(["--disable-log-stats"] if args.disable_log_stats else []),
                *("--metric-names", args.metric_names),
                *engine_argv(args),
            ]
            if role == "decode":
                argv += ["--kv-load-failure-policy", args.kv_load_failure_policy]
            else:  # (a prompt's first token only: no drafts, no draft model to load)
                argv = _without(argv, "--speculative-config")
                argv += ["--kv-lease-ms", str(args.kv_lease_ms)]
                argv += ["--tensor-parallel-size", str(_prefill_tp(args))]
            plan.append((role, f"{role}-{i}" if count > 1 else role, argv))
    gateway_argv = [
        *("--host", args.host, "--port", str(args.port)),
        *itertools.chain.from_iterable(("--decode-addr", a) for a in addrs["decode"]),
        *itertools.chain.from_iterable(("--prefill-addr", a) for a in addrs["prefill"]),
        *kvstore_argv,
        *otlp_argv,
        *("--remote-prefill-threshold", str(args.remote_prefill_threshold)),
        *(
            ["--max-remote-prefill-wait-ms", str(args.max_remote_prefill_wait_ms)]
            if args.max_remote_prefill_wait_ms is not None
            else []
        ),
        *("--served-model-name", name, *(args.served_model_name or [])[1:]),
        *("--connect-timeout", str(args.ready_timeout)),
        *(["--model", args.model] if args.model is not None else []),
        *(["--disable-uvicorn-access-log"] if args.disable_uvicorn_access_log else []),
        *(["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []),
        *(["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []),
        *(["--chat-template", args.chat_template] if args.chat_template is not None else []),
        *(["--reasoning-parser", args.reasoning_parser] if args.reasoning_parser else []),
        *("--response-role", args.response_role),
        *("--uvicorn-log-level", args.uvicorn_log_level),
        *_given_argv(
            args,
            "tokenizer",
            "root_path",
            "uds",
            "ssl_keyfile",
            "ssl_certfile",
            "ssl_ca_certs",
        ),
        *(["--ssl-cert-reqs", str(args.ssl_cert_reqs)] if args.ssl_cert_reqs else []),
        *(["--enable-force-include-usage"] if args.enable_force_include_usage else []),
        *(["--trust-request-chat-template"] if args.trust_request_chat_template else []),
        *("--chat-template-content-format", args.chat_template_content_format),
        *(
            ["--exclude-tools-when-tool-choice-none"]
            if args.exclude_tools_when_tool_choice_none
            else []
        ),
        *(["--enable-tokenizer-info-endpoint"] if args.enable_tokenizer_info_endpoint else []),
        *(
            ["--default-chat-template-kwargs", json.dumps(args.default_chat_template_kwargs)]
            if args.default_chat_template_kwargs is not None
            else []
        ),
        *("--generation-config", args.generation_config),
        *("--allowed-origins", json.dumps(args.allowed_origins)),
        *("--allowed-methods", json.dumps(args.allowed_methods)),
        *("--allowed-headers", json.dumps(args.allowed_headers)),
        *(["--allow-credentials"] if args.allow_credentials else []),
        *itertools.chain.from_iterable(("--middleware", m) for m in args.middleware),
        *(["--return-tokens-as-token-ids"] if args.return_tokens_as_token_ids else []),
        *("--max-stored-responses", str(args.max_stored_responses)),
        *(["--enable-request-id-headers"] if args.enable_request_id_headers else []),
        *(
            ["--override-generation-config", json.dumps(args.override_generation_config)]
            if args.override_generation_config is not None
            else []
        ),
    ]
    plan.append(("gateway", "gateway", gateway_argv))
    return plan


def _given_argv(args: argparse.Namespace, *names: str) -> list[str]:
    """``--name value`` for each of ``names`` that ``args`` sets (not None)."""
    argv: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


_MAX_RESTARTS = 3  # per worker, over the stack's life


def _supervise(
    children: list[Child],
    name: str,
    args: argparse.Namespace,
    stop: threading.Event,
) -> int:
    """Wait for the ready lines, then for a signal or a child's death; the exit status.

    Once serving, a worker or the kvstore that dies is reported and started again (the gateway
    routes around a dead worker meanwhile, and workers re-register with a restarted kvstore);
    the gateway dying, or a child dying before the stack was ready, stops everything.
    """
    deadline = time.monotonic() + args.ready_timeout
    announced = False
    restarts: dict[str, int] = {}
    while not stop.wait(0.1):
        for i, child in enumerate(children):
            code = child.proc.poll()
            if code is None:
                continue
            if not announced or child.kind == "gateway":
                when = "unexpectedly" if announced else "before it was ready"
                print(
                    f"error: baton {child.label} exited {when} with status {code} "
                    "(its output is above); stopping",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            count = restarts.get(child.label, 0)
            if count >= _MAX_RESTARTS:
                if child.forwarder is not None:  # reported once, then left down
                    print(f"Baton: {child.label} stays down after {count} restarts; "
                          "the others keep serving", file=sys.stderr, flush=True)  # fmt: skip
                    child.forwarder = None
                continue
            restarts[child.label] = count + 1
            print(
                f"Baton: {child.label} exited with status {code}; the others keep serving; "
                f"restarting it ({count + 1}/{_MAX_RESTARTS})",
                file=sys.stderr,
                flush=True,
            )
            # Threads exist now: no preexec_fn (the restarted child is stopped by us as usual).
            children[i] = start_child(child.kind, child.label, child.argv, child.env, preexec=False)
            children[i].start_forwarding(sys.stdout)
        if not announced and all(c.ready.is_set() for c in children):
            scheme = "https" if args.ssl_certfile else "http"
            url = f"unix:{args.uds}" if args.uds else f"{scheme}://{args.host}:{args.port}/v1"
            shape = ", ".join(c.label for c in children)
            print(f"Baton is serving {name} at {url} ({args.mode}: {shape})", flush=True)
            announced = True
        elif not announced and time.monotonic() > deadline:
            late = [c.label for c in children if not c.ready.is_set()]
            print(
                f"error: baton {', '.join(late)} not ready after {args.ready_timeout:.0f} s; "
                "stopping",
                file=sys.stderr,
                flush=True,
            )
            return 1
    print("Baton: stopping", file=sys.stderr, flush=True)
    return 0
