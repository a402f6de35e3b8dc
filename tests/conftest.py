"""Shared fixtures: the default model (converted once per machine into ~/.cache/baton) and
Hugging Face reference objects."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _share_the_cores() -> None:
    """Under pytest-xdist (``make test`` runs one worker a core), a worker's torch and every
    process it starts take their share of the cores: torch's default, a thread a core in each
    worker, spent 58% more CPU time on 2 cores than one process did and saved 43 s of 28:30
    (benchmarks/RESULTS.md)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0))
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))


_share_the_cores()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from baton_engine.model_loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    from baton_engine.model_loader import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def hf_model() -> Any:
    """transformers' own loading of the default GGUF file (an independent dequantization),
    float32, in eval mode: the reference several tests compare with, loaded once (~12 s).
    Shared: a test that changes weights changes a copy."""
    import torch
    from transformers import AutoModelForCausalLM

    from baton_engine.model_loader import default_model_path

    gguf = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    ).eval()


# --- Redis --------------------------------------------------------------------------------
# A real redis-server per test (no persistence, loopback only); ``restart()`` brings it back on the
# same port with empty state, as after a crash. Skipped where redis-server is not installed.


@dataclass
class RedisServer:
    """A ``redis-server`` subprocess on ``port``; ``url`` is what clients connect to."""

    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it (on the same port as before) and wait until it answers PING."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill it (SIGKILL: like a crash; nothing is saved)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()
