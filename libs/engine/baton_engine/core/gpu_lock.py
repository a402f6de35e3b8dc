"""One engine at a time sizes its KV cache on a GPU.

An engine's KV budget is its share of the device less what it took since it started, and it
reads "what it took" as the drop in the device's free memory (weights, buffers, CUDA graphs:
torch's allocator does not see all of it). Another process that allocates in that window, such
as a second worker starting on the same GPU, would count as this engine's own and shrink its
pool, down to nothing. So the window, from the first reading of the free memory to the last
graph captured, is held under an exclusive file lock per GPU (``flock``, released by the kernel
if the process dies). Workers sharing a GPU then size their caches one after the other; the rest
of their start-up (imports, tokenizer, servers) still overlaps.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from baton_engine.errors import BatonError

logger = logging.getLogger(__name__)

# How long an engine waits for another to finish starting on a GPU before it gives up: more than
# a large model's load, less than forever behind a start-up that hung.
WAIT_TIMEOUT_S = float(os.environ.get("BATON_GPU_LOCK_TIMEOUT_S", "1800"))


class GpuLockTimeout(BatonError, TimeoutError):
    """Another engine held a GPU's start-up lock for longer than the wait allows."""


def lock_dir() -> Path:
    """Where the lock files live: ``BATON_LOCK_DIR``, else the system's temporary directory
    (shared by every process of the host that should take turns)."""
    return Path(os.environ.get("BATON_LOCK_DIR") or tempfile.gettempdir())


def device_key(index: int) -> str:
    """A name for CUDA device ``index`` that is the same in every process of the host, however
    ``CUDA_VISIBLE_DEVICES`` numbers it: its UUID."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return f"gpu-{uuid}" if uuid is not None else f"gpu-bus-{getattr(props, 'pci_bus_id', index)}"


@contextlib.contextmanager
def hold(
    keys: Sequence[str], what: str = "its KV cache", timeout_s: float | None = None
) -> Iterator[None]:
    """Hold the exclusive lock of every key (sorted, so two holders of overlapping sets cannot
    deadlock) for the ``with`` block; ``GpuLockTimeout`` after ``timeout_s`` (default
    ``WAIT_TIMEOUT_S``) of waiting. A lock that cannot be opened is skipped with a warning: the
    engine then starts as it would without one."""
    deadline = time.monotonic() + (WAIT_TIMEOUT_S if timeout_s is None else timeout_s)
    with contextlib.ExitStack() as stack:
        for key in sorted(set(keys)):
            path = lock_dir() / f"baton-{key}.lock"
            try:
                fd = _open(path)
            except OSError as e:
                logger.warning("cannot open %s (%s): sizing %s without it", path, e, what)
                continue
            stack.callback(os.close, fd)
            _acquire(fd, key, what, deadline)
            stack.callback(fcntl.flock, fd, fcntl.LOCK_UN)
        yield


def _open(path: Path) -> int:
    """The lock file, created if missing; read-only if another user created it (a lock needs
    no write access)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY)


def _acquire(fd: int, key: str, what: str, deadline: float) -> None:
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise GpuLockTimeout(
                    f"another engine has been starting on {key} for too long; not sizing {what} "
                    f"beside it (lock file {lock_dir()}, BATON_GPU_LOCK_TIMEOUT_S to wait longer)"
                ) from None
            if not waited:
                logger.info("waiting for another engine on %s to finish starting", key)
                waited = True
            time.sleep(0.05)
