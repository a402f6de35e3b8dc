"""Decode step time of the offline engine on CPU with N requests running, and where it goes.

    python benchmarks/bench_cpu_step.py [--running 16] [--dtype bfloat16] [--no-profile]
        [--python-layers] [--steps 10]

Admits N random 128-token prompts, runs 5 steps (their prefill and first decodes), then times
``--steps`` decode steps (mean and median); then the torch profiler's top ops over 5 more (C++
kernels called through pybind, such as the paged decode attention, are not listed by the
profiler). ``--python-layers`` runs
the layer loop in Python even where the engine would make it one C++ call (``CpuDecodeLayers``),
for an A/B of that path.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.sampling_params import SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--running", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed")
    p.add_argument("--python-layers", action="store_true", help="no one-call decode layers")
    args = p.parse_args()
    core = EngineCore(
        EngineConfig(dtype=args.dtype, max_model_len=1024, attention_backend=args.attention_backend)
    )
    if args.python_layers:
        core.runner.model.cpu_decode_layers = None
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    for i in range(args.running):
        core.add_request(str(i), [rng.randrange(100, 40000) for _ in range(128)], params)
    for _ in range(5):
        core.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    step_ms = statistics.mean(times) * 1e3
    median_ms = statistics.median(times) * 1e3
    print(f"decode step with {args.running} running ({args.dtype}, {torch.get_num_threads()} "
          f"threads, backend {core.runner.backend.name}, fused ops "
          f"{core.runner.model.fused_rope}, layers in one call "
          f"{core.runner.model.cpu_decode_layers is not None}): {step_ms:.1f} ms mean, "
          f"{median_ms:.1f} ms median")  # fmt: skip
    if not args.no_profile:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                core.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
