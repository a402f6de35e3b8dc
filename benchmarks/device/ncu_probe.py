"""One decode step of issue 5's workload under Nsight Compute: the hardware counters of its
kernels (DRAM throughput, occupancy, why warps stall), in the engine's own state.

    ncu --clock-control none --profile-from-start off -k regex:_decode_kernel --launch-count 3 \
        --section SpeedOfLight --section WarpStateStats ... \
        python3 benchmarks/device/ncu_probe.py --shape qwen --batch 256 --at 200

Builds the engine as ``bench_gpu_engine.py`` does (``probe_engine``), runs its warm-up, adds the
workload and steps until ``--at`` decode-only steps have run; then the profiler is on for
``--steps`` engine steps (``cudaProfilerStart`` / ``cudaProfilerStop``: with
``--profile-from-start off`` ncu profiles only the launches between them, the kernel nodes of
the replayed CUDA graphs included), and the process ends without finishing the run. Without
ncu it runs the same steps and prints their wall times (a smoke run: ``--shape tiny --device
cpu``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_engine import probe_args, probe_engine, random_prompts, warm_up


def main() -> int:
    p = probe_args(__doc__)
    p.add_argument("--at", type=int, default=200, help="decode-only steps before profiling")
    p.add_argument("--steps", type=int, default=2, help="engine steps profiled")
    # ncu saves the memory a kernel may write before each replay pass: leave it room
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    args = p.parse_args()
    core, mc, params = probe_engine(args, gpu_memory_utilization=args.gpu_memory_utilization)
    warm_up(core, mc, params)
    prompts = random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size)
    for i, prompt in enumerate(prompts):
        core.add_request(f"p{i}", prompt, params)
    cuda = args.device == "cuda"
    decode_steps = 0
    while core.has_unfinished_requests() and decode_steps < args.at:
        running = core.scheduler.num_running
        outs = core.step()
        if outs and len(outs) == running and not core.scheduler.num_waiting:
            decode_steps += 1
    print(f"profiling after {decode_steps} decode steps, {core.scheduler.num_running} running")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"{args.steps} steps profiled, {time.perf_counter() - start:.3f} s")
    sys.stdout.flush()
    os._exit(0)  # the run is not finished: no teardown


if __name__ == "__main__":
    sys.exit(main())
