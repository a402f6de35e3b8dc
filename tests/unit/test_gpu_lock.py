"""Engines that start on the same GPU take turns (``baton_engine.core.gpu_lock``): the lock is
exclusive across threads and processes, waits end with a clear error, and a holder that dies
releases it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from baton_engine.core import gpu_lock


@pytest.fixture(autouse=True)
def _lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_LOCK_DIR", str(tmp_path))


def test_a_second_holder_waits_for_the_first() -> None:
    order: list[str] = []
    held = threading.Event()

    def first() -> None:
        with gpu_lock.hold(["gpu-a"]):
            held.set()
            time.sleep(0.3)
            order.append("first done")

    t = threading.Thread(target=first)
    t.start()
    assert held.wait(5)
    with gpu_lock.hold(["gpu-b", "gpu-a"], timeout_s=10):
        order.append("second in")
    t.join()
    assert order == ["first done", "second in"]


def test_waiting_too_long_is_a_clear_error() -> None:
    with gpu_lock.hold(["gpu-a"]):
        start = time.monotonic()
        with (
            pytest.raises(gpu_lock.GpuLockTimeout, match=r"gpu-a.*BATON_GPU_LOCK_TIMEOUT_S"),
            gpu_lock.hold(["gpu-a"], timeout_s=0.2),
        ):
            pass
        assert time.monotonic() - start < 5
    with gpu_lock.hold(["gpu-a"], timeout_s=0.2):  # released, also after the failed wait
        pass


def test_a_killed_holder_releases_the_lock(tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "from baton_engine.core import gpu_lock\n"
        "with gpu_lock.hold(['gpu-a']):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError), gpu_lock.hold(["gpu-a"], timeout_s=0.2):
            pass
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        with gpu_lock.hold(["gpu-a"], timeout_s=5):
            pass
    finally:
        proc.kill()
        proc.wait()
