"""The host CPU's speed as a process sees it: a fixed pure-Python loop's time. The device's
virtual machine runs 1.5-1.8x slower for minutes at a time (twenty-fifth session), and the
engine's host phases with it; the device scripts print this beside each process's figures."""

import time


def calibrate() -> float:
    """Milliseconds of a fixed pure-Python loop (~100-200 ms on the H200's host)."""
    start = time.perf_counter()
    total = 0
    for i in range(2_000_000):
        total += i * i
    return (time.perf_counter() - start) * 1e3
