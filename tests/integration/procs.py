"""Start single Baton services (``baton kvstore|prefill|decode|gateway``) as real processes on
loopback, each waited for by its ready line, and stop them (the tests' own small compose)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton.serve import SHARED_CPU_ENV

READY = re.compile(r"baton (\w+) ready on (\S+?)(?: |$)")
METRICS = re.compile(r"metrics (http://\S+?/metrics)")
ENGINE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory", str(64 << 20), "--dtype", "float32")


@dataclass
class Service:
    kind: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[str]
    address: str = ""  # host:port (gRPC), or http://host:port for the gateway
    metrics_url: str = ""
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    def output(self, last: int = 40) -> str:
        return "".join(self.lines[-last:])

    def metrics(self) -> dict[str, float]:
        """Every sample of the service's Prometheus metrics, by name (labels summed)."""
        text = httpx.get(self.metrics_url, timeout=5).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def start(
    kind: str, argv: Sequence[str], env: dict[str, str] | None = None, timeout_s: float = 300
) -> Service:
    """Start ``baton KIND ARGV`` and wait for its ready line."""
    service = launch(kind, argv, env)
    try:
        wait_all([service], timeout_s)
    except RuntimeError:
        stop([service])
        raise
    return service


def launch(kind: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Service:
    """Start ``baton KIND ARGV``; ``wait_all`` waits for its ready line. A worker gets the
    OpenMP settings ``baton serve`` gives workers that share the cores (as tests' do)."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", UCX_NET_DEVICES="lo")
    if kind in ("prefill", "decode"):
        full_env.update(SHARED_CPU_ENV)
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", kind, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    service = Service(kind, list(argv), full_env, proc)

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            service.lines.append(line)
            if not service.ready.is_set() and (m := READY.search(line)):
                service.address = m.group(2)
                if mm := METRICS.search(line):
                    service.metrics_url = mm.group(1)
                elif kind == "gateway":
                    service.metrics_url = f"{service.address}/metrics"
                service.ready.set()

    threading.Thread(target=drain, daemon=True).start()
    return service


def wait_all(services: Iterable[Service], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    for s in services:
        while not s.ready.wait(0.2):
            if s.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"baton {s.kind} did not start:\n{s.output()}")


def launch_disaggregated(
    services: list[Service], worker_args: Sequence[str] = (), gateway_args: Sequence[str] = ()
) -> Service:
    """A prefill worker, a decode worker and a gateway that prefills every prompt on the
    prefill worker (``--remote-prefill-threshold 0``), appended to ``services`` once ready;
    returns the gateway."""
    workers = [
        launch(kind, ["--port", "0", *worker_args, *ENGINE_ARGS]) for kind in ("prefill", "decode")
    ]
    services += workers
    wait_all(services)
    prefill, decode = workers
    gateway = launch(
        "gateway",
        [
            *("--port", "0", "--disable-uvicorn-access-log", "--remote-prefill-threshold", "0"),
            *("--decode-addr", decode.address, "--prefill-addr", prefill.address),
            *gateway_args,
        ],
    )
    services.append(gateway)
    wait_all(services)
    return gateway


def kill(service: Service, sig: int = signal.SIGKILL) -> None:
    if service.alive:
        os.killpg(service.proc.pid, sig)
    service.proc.wait(30)


def stop(services: Iterable[Service]) -> None:
    """SIGTERM every service (its whole process group), SIGKILL what is left after 20 s."""
    services = list(services)
    for s in services:
        if s.alive:
            os.killpg(s.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    for s in services:
        try:
            s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
