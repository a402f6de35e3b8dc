"""Per-step timeline of issue 5's workload: where the GPU waits, step by step.

    python benchmarks/device/step_timeline.py [--shape qwen] [--batch 256] [--runs 2]

Runs the benchmark's workload (256 x 512 random prompt ids, 256 output tokens, greedy, bf16,
dummy weights) as ``bench_gpu_engine.py`` does, after the same small warm-up, ``--runs`` times in
one engine: the first run sees every step shape for the first time, later ones do not. Each
``core.step()`` is timed on the host by phase (``schedule``, ``launch``, the wait for the
previous step's ids, ``update_from_output``), and on the device by two CUDA events around the
launch: the GPU's span from the step's first queued command to its last, and its idle gap
before the step (the previous step's last command to this step's first). A host that falls
behind shows as gaps; a stall inside a step (a synchronisation, a first-use cost) as a span
longer than the step's kernels.

Prints, per run, the phase totals (prompt phase: steps until every request has its first
token; decode phase: the rest) and the slowest steps with their breakdown. ``--shape tiny
--device cpu`` is a smoke run (host timers only). ``--profile-step N`` runs step N of the first
run under cProfile and prints its costliest calls (a first-use stall shows as the C call that
blocked); the "gc" column is the cyclic collector's time in the step.
"""

from __future__ import annotations

import cProfile
import gc
import io
import json
import pstats
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_engine import probe_args, probe_engine, random_prompts, warm_up

import baton_engine.runner.model_runner as mr
from baton_engine.core.engine_core import EngineCore
from baton_engine.sampling_params import SamplingParams


@dataclass
class Step:
    tokens: int = 0
    decodes: int = 0
    prompts: int = 0
    host: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    events: tuple[Any, Any] | None = None  # CUDA events around the launch
    span_ms: float = float("nan")
    gap_ms: float = float("nan")
    wall: float = 0.0
    outputs: int = 0
    gc_s: float = 0.0


class Recorder:
    """Wraps the engine's phases; one ``Step`` per ``core.step()``."""

    def __init__(self, core: EngineCore, cuda: bool) -> None:
        self.core, self.cuda = core, cuda
        self.steps: list[Step] = []
        self.current = Step()
        self.profile_step = -1  # a step of the next run to run under cProfile
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)
        sched, runner = core.scheduler, core.runner
        self._wrap(sched, "schedule", "schedule", self._on_schedule)
        self._wrap(sched, "update_from_output", "update")
        self._wrap(runner, "launch", "launch", before=self._before_launch, after=self._after_launch)
        self._wrap(runner, "_prepare_inputs", "inputs")  # parts of launch
        self._wrap(runner.model, "forward", "forward")
        orig = mr.StepHandle.result
        rec = self

        def result(handle: Any) -> Any:
            start = time.perf_counter()
            out = orig(handle)
            host = rec.current.host
            host["result"] = host.get("result", 0.0) + time.perf_counter() - start
            return out

        mr.StepHandle.result = result  # type: ignore[method-assign]

    def _wrap(self, obj: Any, name: str, label: str, on_out: Any = None,
              before: Any = None, after: Any = None) -> None:  # fmt: skip
        fn = getattr(obj, name)
        rec = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            host = rec.current.host
            host[label] = host.get(label, 0.0) + time.perf_counter() - start
            if after is not None:
                after()
            if on_out is not None:
                on_out(out)
            return out

        setattr(obj, name, wrapper)

    def _on_schedule(self, so: Any) -> None:
        num = so.num_scheduled_tokens
        self.current.tokens = so.total_num_scheduled_tokens
        self.current.decodes = sum(1 for n in num.values() if n == 1)
        self.current.prompts = len(num) - self.current.decodes

    def _before_launch(self) -> None:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            self.current.events = (start, None)

    def _after_launch(self) -> None:
        if self.cuda and self.current.events is not None:
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end.record()
            self.current.events = (self.current.events[0], end)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.current.gc_s += time.perf_counter() - self._gc_start

    def step(self) -> list[Any]:
        self.current = Step()
        profiler = cProfile.Profile() if len(self.steps) == self.profile_step else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        outs = self.core.step()
        if profiler is not None:
            profiler.disable()
        self.current.wall = time.perf_counter() - start
        if profiler is not None:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            print(f"-- step {self.profile_step} under cProfile ({self.current.wall * 1e3:.2f} ms)")
            print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))
            self.profile_step = -1
        self.current.outputs = len(outs)
        self.steps.append(self.current)
        return outs

    def finish(self) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize()
        prev_end = None
        for s in self.steps:
            if s.events is None or s.events[1] is None:
                continue
            start, end = s.events
            s.span_ms = start.elapsed_time(end)
            if prev_end is not None:
                s.gap_ms = prev_end.elapsed_time(start)
            prev_end = end
            s.events = None


def run(core: EngineCore, rec: Recorder, prompts: list[list[int]], params: SamplingParams,
        tag: str) -> dict[str, Any]:  # fmt: skip
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, params)
    rec.steps = []
    seen: set[str] = set()
    first_all = None
    start = time.perf_counter()
    while core.has_unfinished_requests():
        for o in rec.step():
            seen.add(o.req_id)
        if first_all is None and len(seen) == len(prompts):
            first_all = len(rec.steps)
    elapsed = time.perf_counter() - start
    rec.finish()
    steps = rec.steps
    n_out = sum(s.outputs for s in steps)
    split = first_all or len(steps)
    phases = {"prompt": steps[:split], "decode": steps[split:]}
    summary: dict[str, Any] = {
        "elapsed_s": elapsed,
        "tok_s": n_out / elapsed,
        "phases": {},
        "steps": [
            [
                s.tokens,
                s.decodes,
                s.prompts,
                s.outputs,
                s.wall * 1e3,
                s.span_ms,
                s.gap_ms,
                {k: v * 1e3 for k, v in s.host.items()},
                s.gc_s * 1e3,
            ]
            for s in steps
        ],
    }
    print(f"\n== {tag}: {len(steps)} steps, {elapsed:.3f} s, {n_out / elapsed:,.0f} tok/s")
    print(f"{'phase':7} {'steps':>5} {'wall s':>7} {'GPU span s':>10} {'GPU gaps s':>10} "
          f"{'sched':>6} {'launch':>6} {'inputs':>6} {'fwd':>6} {'result':>6} {'update':>6}"
          "  (host s; inputs and fwd are parts of launch)")  # fmt: skip
    for name, group in phases.items():
        if not group:
            continue
        span = sum(s.span_ms for s in group if s.span_ms == s.span_ms) / 1e3
        gaps = sum(s.gap_ms for s in group if s.gap_ms == s.gap_ms) / 1e3
        host = {k: sum(s.host.get(k, 0.0) for s in group) for k in
                ("schedule", "launch", "inputs", "forward", "result", "update")}  # fmt: skip
        wall = sum(s.wall for s in group)
        summary["phases"][name] = {
            "steps": len(group), "wall_s": wall, "gpu_span_s": span, "gpu_gaps_s": gaps,
            **{f"{k}_s": v for k, v in host.items()},
        }  # fmt: skip
        print(f"{name:7} {len(group):>5} {wall:7.3f} {span:10.3f} {gaps:10.3f} "
              f"{host['schedule']:6.3f} {host['launch']:6.3f} {host['inputs']:6.3f} "
              f"{host['forward']:6.3f} {host['result']:6.3f} {host['update']:6.3f}")  # fmt: skip
    print(f"{'#':>4} {'tokens':>6} {'dec':>4} {'pr':>3} {'wall ms':>8} {'span':>7} {'gap':>6} "
          f"{'sched':>6} {'launch':>6} {'inputs':>6} {'fwd':>6} {'result':>6} "
          f"{'update':>6} {'gc':>5}")  # fmt: skip

    def show(i: int, s: Step) -> None:
        h = s.host
        print(f"{i:>4} {s.tokens:>6} {s.decodes:>4} {s.prompts:>3} {s.wall * 1e3:8.2f} "
              f"{s.span_ms:7.2f} {s.gap_ms:6.2f} {h.get('schedule', 0) * 1e3:6.2f} "
              f"{h.get('launch', 0) * 1e3:6.2f} {h.get('inputs', 0) * 1e3:6.2f} "
              f"{h.get('forward', 0) * 1e3:6.2f} {h.get('result', 0) * 1e3:6.2f} "
              f"{h.get('update', 0) * 1e3:6.2f} {s.gc_s * 1e3:5.2f}")  # fmt: skip

    print("-- the prompt phase and the step after it")
    for i in range(min(split + 2, len(steps))):
        show(i, steps[i])
    decode = list(enumerate(steps))[split + 2 :]
    if decode:
        print("-- the slowest decode steps (wall)")
        for i, s in sorted(decode, key=lambda x: -x[1].wall)[:10]:
            show(i, s)
        walls = sorted(s.wall for _, s in decode)
        spans = sorted(s.span_ms for _, s in decode)
        # What the steps above the median cost in all: the decode phase's time over a median step
        med = walls[len(walls) // 2]
        excess = [(i, s.wall - med) for i, s in decode if s.wall > med]
        big = [(i, x) for i, x in excess if x > 0.5 * med]
        print(
            f"decode steps above the median: {sum(x for _, x in excess) * 1e3:.1f} ms over "
            f"{len(excess)} steps; {sum(x for _, x in big) * 1e3:.1f} ms of it in {len(big)} "
            f"steps over 1.5x the median: " + " ".join(f"#{i}" for i, _ in big[:30])
        )
        tail = [(i, s) for i, s in decode if s.outputs < max(x.outputs for _, x in decode)]
        print(
            f"decode steps with fewer requests than the most: {len(tail)}, "
            f"{sum(s.wall for _, s in tail) * 1e3:.1f} ms"
        )
        print(f"decode steps: wall median {walls[len(walls) // 2] * 1e3:.3f} ms, mean "
              f"{sum(walls) / len(walls) * 1e3:.3f} ms; span median {spans[len(spans) // 2]:.3f}"
              f" ms, mean {sum(spans) / len(spans):.3f} ms")  # fmt: skip
    return summary


def main() -> int:
    p = probe_args(__doc__)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--profile-step", type=int, default=-1, help="of the first run, under cProfile")
    p.add_argument(
        "--gc",
        choices=("default", "freeze", "off"),
        default="default",
        help="after the warm-up: gc.freeze(), or no cyclic collection at all",
    )
    args = p.parse_args()
    core, mc, params = probe_engine(args)
    warm_up(core, mc, params)  # as bench_gpu_engine.py does
    if args.gc == "freeze":
        gc.freeze()
    elif args.gc == "off":
        gc.disable()
    rec = Recorder(core, args.device == "cuda")
    rec.profile_step = args.profile_step
    out = [
        run(core, rec, random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size, seed=k),
            params, f"run {k + 1}")  # fresh prompts each run: no prefix-cache hits
        for k in range(args.runs)
    ]  # fmt: skip
    if args.output_json:
        args.output_json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
