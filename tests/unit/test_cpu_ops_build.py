"""The CPU kernels' build cache: a build killed midway (a worker stopped during its first start)
must not block every later start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from baton_kernels.cpu_ops import _cpu_digest, load_cpu_ops

pytestmark = pytest.mark.skipif(load_cpu_ops() is None, reason="the CPU kernels did not build")

LOAD = "from baton_kernels.cpu_ops import load_cpu_ops; assert load_cpu_ops() is not None"


def test_the_lock_file_of_a_killed_build_does_not_block_the_next_load() -> None:
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(f"baton_cpu_ops_{_cpu_digest()}", verbose=False))
    # What torch's loader leaves behind when its process is killed while building: its lock
    # file, which makes every later load wait for it (for ever, without Baton's own lock).
    (build_dir / "lock").touch()
    try:
        subprocess.run([sys.executable, "-c", LOAD], check=True, timeout=120)
    finally:
        (build_dir / "lock").unlink(missing_ok=True)
