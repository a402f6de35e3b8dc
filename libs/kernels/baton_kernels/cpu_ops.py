"""CPU kernels in C++, compiled on first use with torch's extension loader (needs a C++ compiler
and ninja; ~1 min on 2 cores) and cached per machine under ``~/.cache/torch_extensions``.
``python -m baton_kernels.cpu_ops`` builds them ahead (``make serve`` / ``make test`` do), so no
server's startup or test waits for the compiler.

``load_cpu_ops()`` returns None when they cannot be built (or ``BATON_DISABLE_CPU_KERNELS=1``);
callers then use the PyTorch reference. The build is specialised for this CPU (-march=native), so
the module name carries a digest of the CPU's flags: a cache shared with another CPU model
rebuilds instead of loading instructions this one lacks.
"""

from __future__ import annotations

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
    return hashlib.sha256((platform.machine() + flags).encode()).hexdigest()[:10]


@cache
def load_cpu_ops() -> Any | None:
    if os.environ.get("BATON_DISABLE_CPU_KERNELS") == "1":
        return None
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        ops = load(
            name=f"baton_cpu_ops_{_cpu_digest()}",
            sources=[str(_CSRC / name) for name in _SOURCES],
            # -fopenmp: at::parallel_for is inline and falls back to one thread without it.
            # The module then needs libgomp.so.1, which resolves to the copy torch loaded.
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler or ninja: fall back, do not fail the engine
        logger.warning("CPU kernels unavailable (%s); using the PyTorch reference", e)
        return None
    logger.info("CPU kernels ready (%.1f s)", time.perf_counter() - start)
    return ops


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(
        "CPU kernels:", "ready" if load_cpu_ops() is not None else "unavailable (PyTorch fallback)"
    )
