"""Where a step's time goes on the GPU: torch profiler over the first steps (prompt chunks mixed
with decodes) and over decode-only steps of issue 5's workload, per shape.

    python benchmarks/profile_gpu_steps.py --shapes qwen --num-prompts 256

Prints each profiled step's wall time and the top kernels / host ops by time.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu_engine import SHAPES, engine, random_prompts

from baton_engine.config import ModelConfig
from baton_engine.sampling_params import SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="qwen")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rows", type=int, default=18)
    p.add_argument("--cprofile", action="store_true", help="also profile the host in Python")
    p.add_argument("--only-config", default="1", help=argparse.SUPPRESS)  # engine(): alone
    args = p.parse_args()
    for name in args.shapes.split(","):
        model = SHAPES[name]
        mc = ModelConfig.from_path(model)
        core = engine(model, args, max_num_seqs=args.num_prompts)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for rnd in range(2):  # the second round runs on warm kernels
            for i, prompt in enumerate(random_prompts(args.num_prompts, args.prompt_len,
                                                      mc.vocab_size, seed=rnd)):  # fmt: skip
                core.add_request(f"{rnd}-{i}", prompt, params)
            walls = []
            while core.has_unfinished_requests():
                t0 = time.perf_counter()
                core.step()
                walls.append(time.perf_counter() - t0)
            mixed = walls[:17]
            print(
                f"{name} round {rnd}: {len(walls)} steps, {sum(walls):.2f} s; first 17 steps "
                f"{sum(mixed):.2f} s: " + " ".join(f"{w * 1e3:.0f}" for w in mixed),
                flush=True,
            )
        # profile: two prompt steps, then decode-only steps
        for i, prompt in enumerate(random_prompts(args.num_prompts, args.prompt_len,
                                                  mc.vocab_size, seed=7)):  # fmt: skip
            core.add_request(f"p-{i}", prompt, params)
        if args.cprofile:  # the host side of decode steps, by Python function
            for _ in range(30):
                core.step()
            host = cProfile.Profile()
            host.enable()
            for _ in range(100):
                core.step()
            host.disable()
            print(f"--- {name}: host time of 100 decode steps (cProfile) ---")
            pstats.Stats(host).sort_stats("tottime").print_stats(args.rows)
            pstats.Stats(host).sort_stats("cumulative").print_stats(args.rows)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        for label, nsteps in (("prompt steps", 2), ("skip", 20), ("decode steps", 5)):
            if label == "skip":
                for _ in range(nsteps):
                    core.step()
                continue
            sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
            sync()
            with profile(activities=acts) as prof:
                for _ in range(nsteps):
                    core.step()
                sync()
            print(f"--- {name}: {label} ({nsteps}) ---")
            ka = prof.key_averages()
            by_device = "self_cuda_time_total" if args.device == "cuda" else "cpu_time_total"
            for key in (by_device, "self_cpu_time_total"):
                print(ka.table(sort_by=key, row_limit=args.rows, max_name_column_width=60))
        core.abort_requests(list(core.scheduler.requests))
        del core, prof
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
