"""Decode attention inside the engine: the PyTorch reference backend (gather + SDPA) vs the C++
CPU kernel, timed in one process on the same batch, alternating every 5 steps.

    python benchmarks/bench_decode_attention.py [--num-reqs 64] [--input-len 128] [--rounds 6]

64 requests of 128 random prompt tokens are prefilled, then decoded; the time spent in each
backend's decode attention (all 30 layers) and whole steps are reported per step, bf16.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

from baton.bench.throughput import random_prompts
from baton_engine.llm import LLM
from baton_engine.sampling_params import SamplingParams
from baton_kernels.attention import create_attention_backend


def timed(backend: Any, totals: dict[str, float]) -> Any:
    decode = backend._decode

    def wrapper(*args: Any) -> Any:
        start = time.perf_counter()
        out = decode(*args)
        totals[backend.name] += time.perf_counter() - start
        return out

    backend._decode = wrapper
    return backend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-reqs", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps-per-round", type=int, default=5)
    args = p.parse_args()
    llm = LLM(dtype="bfloat16", max_num_batched_tokens=args.num_reqs * args.input_len)
    core = llm.engine.core
    num_steps = 2 * args.rounds * args.steps_per_round
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 2, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(args.num_reqs, args.input_len, 49152, 0)):
        core.add_request(str(i), prompt, params)
    core.step()  # the prefill
    attention: dict[str, float] = defaultdict(float)
    steps: dict[str, list[float]] = defaultdict(list)
    backends = [timed(create_attention_backend(n), attention) for n in ("torch", "cpu")]
    for _ in range(args.rounds):
        for backend in backends:
            core.runner.backend = backend
            for _ in range(args.steps_per_round):
                start = time.perf_counter()
                core.step()
                steps[backend.name].append((time.perf_counter() - start) * 1e3)
    n = args.rounds * args.steps_per_round
    print(f"{args.num_reqs} decoding requests, {args.input_len}-token prompts, bf16, {n} steps")
    print(f"{'backend':<8} {'attention ms/step':>18} {'median step ms':>15}")
    for name in ("torch", "cpu"):
        median = statistics.median(steps[name])
        print(f"{name:<8} {attention[name] / n * 1e3:>18.1f} {median:>15.1f}")


if __name__ == "__main__":
    main()
