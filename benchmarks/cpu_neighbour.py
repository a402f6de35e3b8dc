"""A neighbour process that takes a set share of one core, to see what it costs the engine.

    python benchmarks/cpu_neighbour.py BUSY_MS IDLE_MS SECONDS &
    python benchmarks/bench_cpu_step.py --no-profile --steps 30

Spins for BUSY_MS, sleeps for IDLE_MS, over and over for SECONDS: a share of
BUSY / (BUSY + IDLE) of a core, taken in slices as a busy client or tokenizer would take it.
"""

import sys
import time


def main() -> None:
    busy_s, idle_s = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        spin_until = time.monotonic() + busy_s
        while time.monotonic() < spin_until:
            pass
        time.sleep(idle_s)


if __name__ == "__main__":
    main()
