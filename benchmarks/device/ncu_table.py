"""A compact table of an ncu CSV (``ncu --csv --page raw --print-units base --metrics ...``, as
``ncu_kernels.sh`` writes it): one line per kernel, then the kernels grouped by name.

    python3 benchmarks/device/ncu_table.py ncu-qwen-256-step.csv
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict

COLUMNS = {  # metric -> (heading, scale)
    "gpu__time_duration.sum": ("us", 1e-3),
    "dram__bytes_read.sum": ("read MB", 1e-6),
    "dram__bytes_write.sum": ("write MB", 1e-6),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("DRAM %", 1.0),
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": ("SM %", 1.0),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("warps %", 1.0),
    "lts__t_sector_hit_rate.pct": ("L2 hit %", 1.0),
    "launch__grid_size": ("grid", 1.0),
    "launch__block_size": ("block", 1.0),
    "launch__registers_per_thread": ("regs", 1.0),
}


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def main(path: str) -> int:
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        print(f"{path}: no kernels")
        return 1
    head = rows[0]
    data = rows[2:]  # rows[1]: units
    name_col = head.index("Kernel Name")
    cols = [(head.index(m), *COLUMNS[m]) for m in COLUMNS if m in head]
    print(f"{'#':>3} {'kernel':44}" + "".join(f"{h:>9}" for _, h, _ in cols) + f"{'GB/s':>8}")
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    total_us = 0.0
    for i, row in enumerate(data):
        name = row[name_col][:44]
        values = {h: number(row[c]) * s for c, h, s in cols}
        us = values.get("us", float("nan"))
        moved = values.get("read MB", 0.0) + values.get("write MB", 0.0)
        gbs = moved / us * 1e3 if us else float("nan")
        print(
            f"{i:>3} {name:44}" + "".join(f"{values[h]:9.2f}" for _, h, _ in cols) + f"{gbs:8.0f}"
        )
        g = groups[name]
        g[0] += 1
        g[1] += us
        g[2] += moved
        total_us += us
    print(f"\n{'kernel':44} {'count':>5} {'us total':>9} {'share':>6} {'GB/s':>7}")
    for name, (count, us, moved) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:44} {count:5.0f} {us:9.1f} {us / total_us:6.1%} {moved / us * 1e3:7.0f}")
    print(f"{'all':44} {len(data):5d} {total_us:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
