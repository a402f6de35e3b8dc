"""Fixtures that start real Baton processes on loopback.

``baton_server`` is ONE ``baton serve`` (gateway + decode worker) shared by the whole session,
started with an API key so the auth tests need no second server. Every process is stopped at
the end, and the fixture fails the session if any child outlives its parent.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
import psutil
import pytest
from openai import OpenAI
from ports import free_port

ENGINE_ARGS = ("--max-model-len", "512", "--kv-cache-memory", "268435456")
API_KEY = "test-key-123"
SERVING = re.compile(r"Baton is serving (\S+) at (\S+)")
DECODE_READY = re.compile(r"baton decode ready on (\S+) ")
START_TIMEOUT_S = 300.0  # first start may convert the GGUF
STOP_TIMEOUT_S = 30.0


@dataclass
class ServeProcess:
    """A running ``baton serve`` and everything it printed (drained by a thread)."""

    proc: subprocess.Popen[str]
    port: int
    lines: list[str] = field(default_factory=list)
    model: str = ""
    base_url: str = ""  # http://127.0.0.1:PORT/v1
    decode_addr: str = ""
    api_key: str | None = None

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self, last: int = 60) -> str:
        return "".join(self.lines[-last:])

    def descendants(self) -> list[psutil.Process]:
        try:
            children: list[psutil.Process] = psutil.Process(self.proc.pid).children(True)
            return children
        except psutil.NoSuchProcess:
            return []


def start_serve(
    extra: Sequence[str] = (), api_key: str | None = None, env: Mapping[str, str] | None = None
) -> ServeProcess:
    """Start ``baton serve`` on a free port (``env``: variables to set for it) and wait for its
    "Baton is serving" line."""
    port = free_port()
    cmd = [sys.executable, "-m", "baton.cli", "serve", "--port", str(port), *ENGINE_ARGS]
    cmd += ["--disable-uvicorn-access-log", *extra]
    env = {**os.environ, **(env or {})}
    env.pop("BATON_API_KEY", None)
    env.pop("VLLM_API_KEY", None)
    if api_key is not None:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    server = ServeProcess(proc, port, api_key=api_key)
    serving = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            server.lines.append(line)
            if m := DECODE_READY.search(line):
                server.decode_addr = m.group(1)
            if m := SERVING.search(line):
                server.model, server.base_url = m.group(1), m.group(2)
                serving.set()

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not serving.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_serve(server)
            pytest.fail(f"baton serve did not start:\n{server.output()}")
    return server


def stop_serve(
    server: ServeProcess, sig: int = signal.SIGTERM
) -> tuple[float, list[psutil.Process]]:
    """Stop ``server`` with ``sig`` (SIGKILL after STOP_TIMEOUT_S); return how long it took to
    exit and the processes it started that were still alive 5 s later (they are killed, so that
    nothing survives a failing test)."""
    children = server.descendants()
    start = time.monotonic()
    if server.proc.poll() is None:
        server.proc.send_signal(sig)
    try:
        server.proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
    elapsed = time.monotonic() - start
    _, alive = psutil.wait_procs(children, timeout=5)
    for p in alive:
        p.kill()
    return elapsed, alive


@pytest.fixture(scope="session")
def baton_server() -> Iterator[ServeProcess]:
    server = start_serve(
        (
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
            "--enable-request-id-headers",
            "--trust-request-chat-template",  # (tests bring their own templates)
        ),
        api_key=API_KEY,
        env={"VLLM_SERVER_DEV_MODE": "1"},  # (POST /reset_prefix_cache)
    )
    yield server
    _, survivors = stop_serve(server)
    assert not survivors, f"processes left behind: {survivors}"


@pytest.fixture(scope="module")
def client(baton_server: ServeProcess) -> Iterator[OpenAI]:
    """The official SDK on the shared server."""
    with OpenAI(base_url=baton_server.base_url, api_key=baton_server.api_key, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(baton_server: ServeProcess) -> Iterator[httpx.Client]:
    """Plain HTTP on the shared server (its root, with the API key)."""
    headers = {"Authorization": f"Bearer {baton_server.api_key}"}
    with httpx.Client(base_url=baton_server.root_url, headers=headers, timeout=60) as c:
        yield c


@dataclass(frozen=True)
class ServeLauncher:
    """Starts and stops extra ``baton serve`` processes (for tests that end them)."""

    start: Callable[..., ServeProcess] = start_serve
    stop: Callable[..., tuple[float, list[psutil.Process]]] = stop_serve


@pytest.fixture(scope="session")
def serve_launcher() -> ServeLauncher:
    return ServeLauncher()
