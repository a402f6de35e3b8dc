"""Which host-device synchronisations a run of issue 5's workload makes, by source line.

    python benchmarks/device/sync_probe.py [--shape qwen] [--batch 256] [--output-len 8]

Builds the engine as ``bench_gpu_engine.py`` does, warms it up the same way, then runs the
workload with ``torch.cuda.set_sync_debug_mode("warn")``: torch warns at every operation that
waits for the device (``.item()``, ``.tolist()`` of a device tensor, ``nonzero``, a copy to
pageable host memory, a stream synchronisation). Waits the engine means to make (the sampled
ids' event) are not torch operations and do not show. Prints each warning's engine frames
with its count, and the CUDA allocator's device allocations (``cudaMalloc``, which also
serialises with the device) during the run.
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_engine import probe_args, probe_engine, random_prompts, run_all, warm_up


def main() -> int:
    p = probe_args(__doc__)
    p.set_defaults(output_len=8)
    args = p.parse_args()
    core, mc, params = probe_engine(args)
    warm_up(core, mc, params)
    prompts = random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size)
    seen: collections.Counter[str] = collections.Counter()

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        frames = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if "baton" in f.filename or "benchmarks" in f.filename
        ]
        seen[f"{str(message)[:80]}\n    " + "\n    ".join(frames[-5:])] += 1

    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    before = stats.get("num_device_alloc", 0)
    warnings.showwarning = show
    warnings.simplefilter("always")
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    try:
        r = run_all(core, prompts, params)
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
    after = torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_available() else 0
    n_out = sum(len(t) for t in r["tokens"].values())
    print(f"{n_out} tokens in {r['elapsed']:.3f} s; device allocations during the run: "
          f"{after - before}")  # fmt: skip
    print(f"{sum(seen.values())} synchronising operations at {len(seen)} places:")
    for where, count in seen.most_common(20):
        print(f"{count:6}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
