"""Loopback ports for the servers the tests start."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_LOWEST = 20000
_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _worker_slice(low: int, high: int) -> tuple[int, int]:
    """This pytest-xdist worker's share of [low, high): workers running side by side never
    hand out the same port (the whole range outside xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return low, high
    index, width = int(worker[2:]), (high - low) // count
    return low + index * width, low + (index + 1) * width


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a process the test starts to bind later. Taken below
    the kernel's ephemeral range, from which every bind to port 0 draws (a worker's gRPC or
    metrics server, a tensor-parallel rendezvous store, a client socket): a port found by
    binding 0 and closing is free for any of those to take before the intended server binds
    it (``make test`` once saw ``baton serve``'s own worker take the gateway's port). Never
    the same port twice in a session, nor one another xdist worker may hand out; an ephemeral
    port if none is free below the range."""
    low, high = _worker_slice(_LOWEST, _ephemeral_start())
    rng = random.Random()
    if high - low >= 1000:
        for _ in range(200):
            port = rng.randrange(low, high)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
