"""Loopback ports for the servers the tests start."""

from __future__ import annotations

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


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a process the test starts to bind later. Taken below
    the kernel's ephemeral range, from which every bind to port 0 draws (a worker's gRPC or
    metrics server, a tensor-parallel rendezvous store, a client socket): a port found by
    binding 0 and closing is free for any of those to take before the intended server binds
    it (``make test`` once saw ``baton serve``'s own worker take the gateway's port). Never
    the same port twice in a session; an ephemeral port if none is free below the range."""
    start = _ephemeral_start()
    rng = random.Random()
    if start - _LOWEST >= 1000:
        for _ in range(200):
            port = rng.randrange(_LOWEST, start)
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
