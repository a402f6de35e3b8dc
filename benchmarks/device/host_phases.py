"""Where a decode step's host time goes on the GPU path (issue 5: Qwen at 256, once host-bound).

    python benchmarks/device/host_phases.py [--shape qwen] [--batch 256]

Wraps the engine's phases with wall-clock timers over 100 decode-only steps at full batch
(medians, no profiler overhead); times ``graph.replay()`` on an idle GPU and with a replay of
the same or another graph still running (does a launch wait?); then lists the host's CUDA/torch
calls by self CPU time over 5 steps under the torch profiler.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_engine import probe_args, probe_engine, random_prompts

import baton_engine.runner.model_runner as mr

TIMES: dict[str, list[float]] = {}


def timed(obj: Any, name: str, label: str | None = None) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        TIMES.setdefault(label or name, []).append(time.perf_counter() - start)
        return out

    setattr(obj, name, wrapper)


def main() -> int:
    args = probe_args(__doc__).parse_args()
    core, mc, params = probe_engine(args)
    for rnd in range(2):
        for i, prompt in enumerate(random_prompts(args.batch, args.prompt_len, mc.vocab_size, rnd)):
            core.add_request(f"{rnd}-{i}", prompt, params)
        if rnd == 0:
            while core.has_unfinished_requests():
                core.step()
    while core.scheduler.num_waiting:
        core.step()
    for _ in range(20):  # past the last prompt chunks
        core.step()
    runner, sched = core.runner, core.scheduler
    timed(sched, "schedule")
    timed(sched, "update_from_output")
    timed(runner, "launch")
    timed(runner, "_run_decode_graph", "launch: inputs + graph replay")
    timed(runner.model, "compute_logits", "launch: LM head")
    timed(runner, "_to_host", "launch: copy ids to host")
    if runner.graphs is not None:
        timed(runner.graphs, "run", "graph.run (copies + replay)")
    orig = mr.StepHandle.result

    def result(self: Any) -> Any:
        start = time.perf_counter()
        out = orig(self)
        TIMES.setdefault("result (wait + tolist + append)", []).append(time.perf_counter() - start)
        return out

    mr.StepHandle.result = result  # type: ignore[method-assign]
    steps = []
    for _ in range(100):
        start = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - start)
    step_ms = statistics.median(steps) * 1e3
    print(f"{args.shape} batch {args.batch}: decode step median {step_ms:.3f} ms")
    for name, values in TIMES.items():
        print(f"  {name:40} median {statistics.median(values) * 1e3:7.3f} ms  (n={len(values)})")
    graphs = runner.graphs
    if graphs is not None and len(graphs._graphs) > 1:
        # Does launching a graph wait while a launch of the same graph is still running?
        sizes = sorted(graphs._graphs)[-2:]  # ((LoRA on, size) keys)
        ga, gb = graphs._graphs[sizes[-1]], graphs._graphs[sizes[0]]
        probe: dict[str, list[float]] = {}
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ga.replay()
            t1 = time.perf_counter()
            ga.replay()
            t2 = time.perf_counter()
            gb.replay()
            t3 = time.perf_counter()
            ga.replay()
            t4 = time.perf_counter()
            probe.setdefault("replay on an idle GPU", []).append(t1 - t0)
            probe.setdefault("same graph again, first in flight", []).append(t2 - t1)
            probe.setdefault("another graph, the first in flight", []).append(t3 - t2)
            probe.setdefault("first graph after the other", []).append(t4 - t3)
        torch.cuda.synchronize()
        for name, values in probe.items():
            print(f"  launch probe: {name:40} median {statistics.median(values) * 1e3:7.3f} ms")
    cuda = args.device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            core.step()
        if cuda:
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                    max_name_column_width=50))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
