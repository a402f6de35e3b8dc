"""Scheduler overhead per decode step, with a fake model runner (no model, no torch).

256 running requests with 128-token prompts, already prefilled, decode for ~500 steps. Times
``schedule()`` and ``update_from_output()`` with ``time.perf_counter`` and prints mean, p50 and
p99 in milliseconds. The target is < 1 ms per step (schedule + update).

    python benchmarks/bench_scheduler.py [--num-requests 256] [--steps 500] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time

from baton_engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from baton_engine.core.scheduler import Scheduler
from baton_engine.kv_cache import KVCacheManager
from baton_engine.request import Request
from baton_engine.sampling_params import SamplingParams

TARGET_MS = 1.0


def make_scheduler(
    num_requests: int, prompt_len: int, num_steps: int, block_size: int
) -> Scheduler:
    blocks_per_request = -(-(prompt_len + num_steps + 16) // block_size)
    kv = KVCacheManager(2 * num_requests * blocks_per_request, block_size, enable_caching=True)
    scheduler = Scheduler(
        kv,
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(8192, num_requests * prompt_len),
        max_model_len=prompt_len + num_steps + 64,
    )
    params = SamplingParams(max_tokens=num_steps + 32, ignore_eos=True)
    for i in range(num_requests):
        start = 1000 * (i + 1)  # unrelated prompts: no prefix hits
        scheduler.add_request(
            Request(
                req_id=f"req-{i}",
                prompt_token_ids=list(range(start, start + prompt_len)),
                sampling_params=params,
                max_tokens=num_steps + 32,
            )
        )
    return scheduler


def fake_runner(scheduler: Scheduler, so: SchedulerOutput) -> ModelRunnerOutput:
    """Sample token 7 for every scheduled request whose prefill is complete."""
    requests = scheduler.requests
    sampled = {}
    for req_id in so.num_scheduled_tokens:
        request = requests[req_id]
        if request.num_computed_tokens == request.num_tokens:
            sampled[req_id] = 7
    return ModelRunnerOutput(sampled_token_ids=sampled)


def run(
    num_requests: int, prompt_len: int, num_steps: int, block_size: int
) -> tuple[list[float], list[float]]:
    """Per-step schedule() and update_from_output() times in seconds."""
    scheduler = make_scheduler(num_requests, prompt_len, num_steps, block_size)
    so = scheduler.schedule()  # prefill every prompt in one step
    assert len(so.scheduled_new_reqs) == num_requests
    scheduler.update_from_output(so, fake_runner(scheduler, so))
    schedule_s: list[float] = []
    update_s: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # measure the code, not when the collector happens to run
    try:
        for _ in range(num_steps):
            t0 = time.perf_counter()
            so = scheduler.schedule()
            t1 = time.perf_counter()
            runner_output = fake_runner(scheduler, so)
            t2 = time.perf_counter()
            scheduler.update_from_output(so, runner_output)
            t3 = time.perf_counter()
            scheduler.kv.take_events()  # what the kvstore publisher would do; untimed
            assert len(so.num_scheduled_tokens) == num_requests
            schedule_s.append(t1 - t0)
            update_s.append(t3 - t2)
    finally:
        if gc_was_enabled:
            gc.enable()
    assert scheduler.num_running == num_requests and scheduler.num_preemptions == 0
    scheduler.check_invariants()
    return schedule_s, update_s


def summarize(times_s: list[float]) -> tuple[float, float, float]:
    ms = sorted(t * 1e3 for t in times_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return statistics.fmean(ms), statistics.median(ms), p99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs; the best mean is reported")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one run")
    args = parser.parse_args()
    shape = (args.num_requests, args.prompt_len, args.steps, args.block_size)

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run(*shape)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
        return

    best: tuple[list[float], list[float]] | None = None
    for _ in range(args.repeats):
        result = run(*shape)
        if best is None or sum(map(sum, result)) < sum(map(sum, best)):
            best = result
    assert best is not None
    schedule_s, update_s = best
    total_s = [a + b for a, b in zip(schedule_s, update_s, strict=True)]
    print(
        f"{args.num_requests} running requests, {args.prompt_len}-token prompts, "
        f"{args.steps} decode steps, block_size {args.block_size} (best of {args.repeats})"
    )
    print(f"{'ms per step':<22}{'mean':>8}{'p50':>8}{'p99':>8}")
    for name, times in [
        ("schedule()", schedule_s),
        ("update_from_output()", update_s),
        ("total", total_s),
    ]:
        mean, p50, p99 = summarize(times)
        print(f"{name:<22}{mean:>8.3f}{p50:>8.3f}{p99:>8.3f}")
    mean = summarize(total_s)[0]
    verdict = "meets" if mean < TARGET_MS else "misses"
    print(f"mean total {mean:.3f} ms {verdict} the {TARGET_MS:.0f} ms target")


if __name__ == "__main__":
    main()
