"""Where a decode step's GPU time goes inside the engine's run (issue 5, Qwen at 256): CUDA
events around the parts of each decode launch, against the same graph replayed alone.

    python benchmarks/device/decode_parts.py [--shape qwen] [--batch 256]

Runs the benchmark's workload once as ``bench_gpu_engine.py`` does (after its warm-up). In every
decode-only step the launch is timed on the device in four parts: the inputs (host-to-device
copies and the pending-token patch), the captured graph's replay, the LM head, and the rest
(argmax, the copy of the sampled ids). After the run, the 256-row graph replayed alone
(back-to-back, as the benchmark's "graph ms" did), alone and with the LM head and argmax: its
buffers then hold the run's last decode step, whose rows past its few requests are padding
(length 1). Then the torch profiler over 2 prompt steps and 6 decode steps of a second run:
each kernel's time as the distance from its start to the next kernel's start on the stream
(under programmatic dependent launch kernels overlap, so their durations double count), summed
by kernel name.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_engine import probe_args, probe_engine, random_prompts, warm_up

import baton_engine.runner.model_runner as mr
from baton_engine.runner.cuda_graphs import DecodeGraphs
from baton_kernels import fused

PARTS = ("inputs", "graph", "head", "rest")


class Probe:
    def __init__(self) -> None:
        self.active = False
        self.steps: list[list[torch.cuda.Event]] = []
        self.marks: list[torch.cuda.Event] = []

    def mark(self) -> None:
        if self.active:
            e = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e.record()
            self.marks.append(e)


def install(probe: Probe, core: Any) -> None:
    runner = core.runner
    graphs = runner.graphs
    run, replay_of = DecodeGraphs.run, graphs._graphs

    def graphs_run(self: Any, *a: Any, **kw: Any) -> Any:
        # replay is wrapped per graph object: mark just before and after it
        for g in replay_of.values():
            if not hasattr(g, "_probe_replay"):
                g._probe_replay = g.replay

                def replay(g: Any = g) -> None:
                    probe.mark()
                    g._probe_replay()
                    probe.mark()

                g.replay = replay
        return run(self, *a, **kw)

    DecodeGraphs.run = graphs_run  # type: ignore[method-assign]
    head = runner.model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        out = head(hidden)
        probe.mark()
        return out

    runner.model.compute_logits = compute_logits
    launch = mr.ModelRunner.launch

    def launched(self: Any, so: Any, *rest: Any) -> Any:
        one_each = so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) > 0
        probe.active = one_each
        probe.marks = []
        probe.mark()
        handle = launch(self, so, *rest)
        probe.mark()
        if one_each and len(probe.marks) == 5:
            probe.steps.append(probe.marks)
        probe.active = False
        return handle

    mr.ModelRunner.launch = launched  # type: ignore[method-assign]


def kernel_table(prof: Any, num_steps: int, what: str) -> None:
    events = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
    ]
    events.sort(key=lambda e: e.time_range.start)
    by_start: dict[str, float] = defaultdict(float)
    by_dur: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for e, nxt in itertools.pairwise(events):
        gap = nxt.time_range.start - e.time_range.start
        by_start[e.name[:70]] += min(gap, e.time_range.elapsed_us() + 50)
        by_dur[e.name[:70]] += e.time_range.elapsed_us()
        counts[e.name[:70]] += 1
    span = events[-1].time_range.end - events[0].time_range.start if events else 0
    print(f"\nprofiler: {len(events)} device events over {num_steps} {what} steps, span "
          f"{span / num_steps / 1e3:.3f} ms a step; per step (us): start-to-next-start, duration,"
          " calls")  # fmt: skip
    total = 0.0
    for name, t in sorted(by_start.items(), key=lambda x: -x[1])[:25]:
        total += t
        print(f"  {t / num_steps:8.1f} {by_dur[name] / num_steps:8.1f} "
              f"{counts[name] / num_steps:5.1f}  {name}")  # fmt: skip
    print(f"  {sum(by_start.values()) / num_steps:8.1f} in all")


def main() -> int:
    p = probe_args(__doc__)
    args = p.parse_args()
    core, mc, params = probe_engine(args)
    print(f"decode graphs: {core.runner.graphs is not None}; prompt pieces: "
          f"{core.runner.pieces is not None}")  # fmt: skip
    warm_up(core, mc, params)
    probe = Probe()
    install(probe, core)
    prompts = random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size)
    for i, prompt in enumerate(prompts):
        core.add_request(f"a{i}", prompt, params)
    while core.has_unfinished_requests():
        core.step()
    torch.cuda.synchronize()
    print(f"decode steps by graph size: {dict(core.runner.graphs.num_steps)}")
    rows = defaultdict(list)
    for e in probe.steps:
        parts = [a.elapsed_time(b) for a, b in itertools.pairwise(e)]
        for name, ms in zip(PARTS, parts, strict=True):
            rows[name].append(ms)
        rows["launch"].append(e[0].elapsed_time(e[-1]))
    gaps = [a[-1].elapsed_time(b[0]) for a, b in zip(probe.steps, probe.steps[1:], strict=False)]
    print(f"{len(probe.steps)} decode steps, GPU ms per step (median / mean):")
    for name in (*PARTS, "launch"):
        v = rows[name]
        print(f"  {name:8} {statistics.median(v):7.3f} {statistics.fmean(v):7.3f}")
    print(f"  {'gap':8} {statistics.median(gaps):7.3f} {statistics.fmean(gaps):7.3f}  (this "
          "launch's end to the next one's start)")  # fmt: skip

    graphs = core.runner.graphs
    size = graphs.padded_size(args.batch)
    graph = graphs._graphs[False, size]  # (LoRA off)
    replay = getattr(graph, "_probe_replay", graph.replay)
    hidden = graphs._outputs[False, size]
    model = core.runner.model

    @torch.inference_mode()
    def timed(fn: Any, reps: int = 50) -> float:
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        return float(a.elapsed_time(b)) / reps

    print(
        f"alone: graph {timed(replay):.3f} ms; graph + head + argmax "
        f"{timed(lambda: (replay(), fused.argmax(model.compute_logits(hidden)))):.3f} ms; "
        f"head + argmax {timed(lambda: fused.argmax(model.compute_logits(hidden))):.3f} ms"
    )

    for i, prompt in enumerate(random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size, 3)):
        core.add_request(f"b{i}", prompt, params)
    for what, skip, num in (("prompt", 1, 2), ("decode", 37, 6)):
        for _ in range(skip):
            core.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(num):
                core.step()
            torch.cuda.synchronize()
        kernel_table(prof, num, what)
    core.abort_requests(list(core.scheduler.requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
