"""``baton serve`` as a process tree: it serves, and it leaves nothing behind when it ends."""

from __future__ import annotations

import signal
import time
from typing import Any

import httpx
import psutil
import pytest

pytestmark = pytest.mark.integration


def _services(server: Any) -> dict[str, psutil.Process]:
    """The serve process's children by service name ("decode", "gateway")."""
    out = {}
    for p in server.descendants():
        cmd = p.cmdline()
        for name in ("decode", "gateway"):
            if "baton.cli" in cmd and name in cmd:
                out[name] = p
    return out


def test_serve_answers_then_sigterm_stops_every_process(serve_launcher: Any) -> None:
    server = serve_launcher.start()
    try:
        services = _services(server)
        assert sorted(services) == ["decode", "gateway"]
        resp = httpx.post(
            f"{server.base_url}/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "SmolLM2-135M-Instruct"
    finally:
        elapsed, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert server.proc.returncode == 0, server.output()
    assert elapsed < 10, f"took {elapsed:.1f} s to stop"
    assert not survivors, f"left behind: {survivors}"
    assert not any(p.is_running() for p in services.values())


def test_serve_exits_nonzero_when_a_child_dies(serve_launcher: Any) -> None:
    server = serve_launcher.start()
    try:
        services = _services(server)
        services["decode"].kill()
        deadline = time.monotonic() + 20
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.proc.poll() not in (None, 0), server.output()
        assert "exited unexpectedly" in server.output()
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"
    assert not services["gateway"].is_running()
