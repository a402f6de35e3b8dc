"""Where a process's threads ran and what memory it got, for the slow-process probe
(slow_processes.sh): one engine process in two to four runs the same workload 1.5-1.8x slower
on the H200's host (every host phase alike, the GPU's graph unchanged), and a pure-Python loop
timed before and after the workload (cpu_speed.py) did not tell the slow ones apart.

``start()`` begins sampling, every ``interval_s``, which CPU each of the process's threads is
on and its CPU time; ``report()`` prints, for the main thread, the CPUs it ran on, how often
another thread of the process that was busy meanwhile sat on the same CPU (the two then share
that CPU's time), the busiest other threads, and the process's transparent huge pages (which
change the cost of every memory access of an object-heavy Python loop)."""

from __future__ import annotations

import collections
import itertools
import os
import threading
from pathlib import Path

_samples: list[dict[int, tuple[int, int]]] = []  # per sample: tid -> (cpu, utime + stime ticks)
_stop = threading.Event()


def _threads() -> dict[int, tuple[int, int]]:
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        # after the name: state is field 3, utime 14, stime 15, processor 39 (1-based)
        out[int(task.name)] = (int(fields[36]), int(fields[11]) + int(fields[12]))
    return out


def start(interval_s: float = 0.05) -> None:
    def sample() -> None:
        while not _stop.wait(interval_s):
            _samples.append(_threads())

    threading.Thread(target=sample, name="placement", daemon=True).start()


def report() -> None:
    _stop.set()
    main = threading.main_thread().native_id
    sampler = {t.native_id for t in threading.enumerate() if t.name == "placement"}
    main_cpus: collections.Counter[int] = collections.Counter()
    shared = 0
    busy_ticks: collections.Counter[int] = collections.Counter()
    for before, now in itertools.pairwise(_samples):
        if main not in now:
            continue
        cpu = now[main][0]
        main_cpus[cpu] += 1
        busy = {
            tid
            for tid, (_, ticks) in now.items()
            if tid != main and tid not in sampler and ticks > before.get(tid, (0, ticks))[1]
        }
        for tid in busy:
            busy_ticks[tid] += now[tid][1] - before[tid][1]
        shared += any(now[tid][0] == cpu for tid in busy)
    n = sum(main_cpus.values())
    last = _samples[-1] if _samples else {}
    top = ", ".join(f"{cpu}: {k}" for cpu, k in main_cpus.most_common(4))
    print(f"placement: main thread on CPUs (samples) {top}; a busy thread on its CPU in "
          f"{shared} of {n} samples")  # fmt: skip
    others = ", ".join(
        f"tid {tid} ({ticks} ticks, last on {last.get(tid, (-1, 0))[0]})"
        for tid, ticks in busy_ticks.most_common(4)
    )
    print(f"placement: busiest other threads: {others or 'none'}")
    smaps = Path("/proc/self/smaps_rollup")
    rollup = smaps.read_text() if smaps.exists() else ""
    mem = {
        line.split(":")[0]: line.split()[1]
        for line in rollup.splitlines()
        if line.startswith(("Rss:", "AnonHugePages:"))
    }
    thp_file = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp = thp_file.read_text().strip() if thp_file.exists() else "?"
    print(f"placement: Rss {mem.get('Rss', '?')} kB, AnonHugePages "
          f"{mem.get('AnonHugePages', '?')} kB, THP {thp}, pid {os.getpid()}")  # fmt: skip
