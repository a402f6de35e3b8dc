"""CPU kernels in C++, compiled on first use with torch's extension loader (needs a C++ compiler
and ninja; ~1 min on 2 cores) and cached per machine under ``~/.cache/torch_extensions``.
``python -m baton_kernels.cpu_ops`` builds them ahead (``make serve`` / ``make test`` do), so no
server's startup or test waits for the compiler.

``load_cpu_ops()`` returns None when they cannot be built (or ``BATON_DISABLE_CPU_KERNELS=1``);
callers then use the PyTorch reference. ``BATON_DISABLE_AMX=1`` keeps the bf16 GEMM off the AMX
tiles of CPUs that have them (its AVX512-BF16 path then runs every product). The build is
specialised for this CPU (-march=native), so the module name carries a digest of the CPU's
flags: a cache shared with another CPU model rebuilds instead of loading instructions this one
lacks. The digest covers the sources' folder too, so two checkouts on one machine keep a build
each instead of rebuilding the other's.

torch serialises builds with a lock file that a process killed mid-build leaves behind, after
which every later load waits for it forever. Baton's processes take an ``flock`` (released by
the kernel when its holder dies) around the load instead, so torch's lock found by the holder
is stale and is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import time
from functools import cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (
    "paged_attention_cpu.cpp",
    "prefill_attention_cpu.cpp",
    "fused_ops_cpu.cpp",
    "gemm_bf16_cpu.cpp",
    "decode_layers_cpu.cpp",
    "bindings.cpp",
)


def _cpu_digest() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    key = platform.machine() + flags + str(_CSRC.resolve())
    return hashlib.sha256(key.encode()).hexdigest()[:10]


@cache
def load_cpu_ops() -> Any | None:
    if os.environ.get("BATON_DISABLE_CPU_KERNELS") == "1":
        return None
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = f"baton_cpu_ops_{_cpu_digest()}"
        build_dir = Path(_get_build_directory(name, verbose=False))  # (made if missing)
        with open(build_dir / "baton.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)  # torch's, left by a killed build
            ops = load(
                name=name,
                sources=[str(_CSRC / source) for source in _SOURCES],
                # -fopenmp: at::parallel_for is inline and falls back to one thread without
                # it. The module then needs libgomp.so.1, which resolves to the copy torch
                # loaded.
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as e:  # no compiler or ninja: fall back, do not fail the engine
        logger.warning("CPU kernels unavailable (%s); using the PyTorch reference", e)
        return None
    amx = ops.amx_gemm_available() and os.environ.get("BATON_DISABLE_AMX") != "1"
    ops.use_amx_gemm(amx)
    tiles = "; bf16 GEMMs on AMX tiles" if amx else ""
    logger.info("CPU kernels ready (%.1f s)%s", time.perf_counter() - start, tiles)
    return ops


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(
        "CPU kernels:", "ready" if load_cpu_ops() is not None else "unavailable (PyTorch fallback)"
    )
