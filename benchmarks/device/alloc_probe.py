"""Where the CUDA caching allocator goes to the driver during issue 5's workload.

    python benchmarks/device/alloc_probe.py [--shape qwen] [--batch 256] [--runs 2]

Builds the engine and warms it up as ``bench_gpu_engine.py`` does, then runs the workload
``--runs`` times with torch's allocator history on. For each run: the allocator's counters over
it (``cudaMalloc`` / ``cudaFree`` calls, retries after a failed ``cudaMalloc``, which free the
cache and synchronise every stream) and each segment allocation or release with its size, the
step it fell in and the engine frames that asked for it. A ``cudaMalloc`` or ``cudaFree`` in the
middle of a step blocks the host, and ``cudaFree`` waits for the device: the suspects for the
first mixed step's 14-20 ms in ``_prepare_inputs`` (thirty-third session).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_engine import probe_args, probe_engine, random_prompts, warm_up

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def frames(event: dict[str, Any]) -> str:
    mine = [
        f"{Path(f['filename']).name}:{f['line']} {f['name']}"
        for f in event.get("frames", [])
        if "baton" in f["filename"] or "benchmarks" in f["filename"]
    ]
    return " <- ".join(mine[:4])


def main() -> int:
    p = probe_args(__doc__)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    core, mc, params = probe_engine(args)
    warm_up(core, mc, params)
    print(f"after start-up: reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB, "
          f"free on the device {torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB")  # fmt: skip
    for k in range(args.runs):
        prompts = random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size, seed=k)
        for i, prompt in enumerate(prompts):
            core.add_request(f"run{k}-{i}", prompt, params)
        before = torch.cuda.memory_stats()
        torch.cuda.memory._record_memory_history(context="all", stacks="python")
        step_starts: list[int] = []  # microseconds, the allocator trace's clock
        start = time.perf_counter()
        while core.has_unfinished_requests():
            step_starts.append(int(time.time() * 1e6))
            core.step()
        elapsed = time.perf_counter() - start
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        after = torch.cuda.memory_stats()
        counts = ", ".join(f"{c} {after.get(c, 0) - before.get(c, 0)}" for c in COUNTERS)
        print(f"\n== run {k + 1}: {len(step_starts)} steps, {elapsed:.3f} s "
              f"(with the history on); {counts}")  # fmt: skip
        for trace in snap.get("device_traces", []):
            for e in trace:
                if not e["action"].startswith("segment") and e["action"] != "oom":
                    continue
                step = sum(1 for s in step_starts if s <= e.get("time_us", 0)) - 1
                at = (e.get("time_us", 0) - step_starts[0]) / 1e3
                print(f"  step {step:4} ({at:8.1f} ms): {e['action']:13} "
                      f"{e['size'] / 2**20:9.1f} MiB  "
                      f"{frames(e)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
