"""Sleep mode (``enable_sleep_mode``): what an idle engine gives back and what waking costs,
against starting a fresh engine (what a user without sleep mode does to free the device).

One engine runs ``--prompts`` greedy requests (``--max-tokens`` each, ``ignore_eos``), then for
each level: sleep, wake the weights, wake the KV cache (the CUDA graphs are captured again
there), and the same requests again. The table gives each phase's seconds, the device memory
in use by this process after it (``torch.cuda.memory_allocated`` plus the graphs' and caching
allocator's reserve: ``memory_reserved``; on a CPU: the process's resident set), and whether
the tokens after waking equal the first run's; "device": the GPU's memory in use by every
process (``mem_get_info``: what sleeping gives others). Level 2 reads the weights again: from
the model's files, or a fresh dummy draw (``--load-format dummy``: no disk read, so its time is
a floor).

    python benchmarks/bench_sleep.py                                                  # CPU
    python benchmarks/bench_sleep.py --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from typing import Any


def memory_gib(device: str) -> tuple[float, float, float]:
    """GiB (allocated, reserved by the caching allocator, used on the whole device: what other
    processes cannot have) on a GPU; the resident set thrice on a CPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        return alloc / 2**30, reserved / 2**30, (total - free) / 2**30
    with open(f"/proc/{os.getpid()}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    return rss, rss, rss


def print_segments() -> None:
    """The caching allocator's largest segments: bytes, bytes in use, stream, pool."""
    import torch

    segments = torch.cuda.memory._snapshot()["segments"]
    for seg in sorted(segments, key=lambda s: -s["total_size"])[:6]:
        print(
            f"  segment {seg['total_size'] / 2**20:9.1f} MiB, {seg['allocated_size'] / 2**20:8.1f}"
            f" in use, stream {seg['stream']}, pool {seg.get('segment_pool_id')}"
        )


def run(core: Any, prompts: list[list[int]], params: Any, tag: str) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        core.add_request(f"{tag}{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.req_id[len(tag) :], []).extend(out.new_token_ids)
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a folder (default: the default model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--levels", default="1,2")
    ap.add_argument(
        "--segments", action="store_true", help="GPU: the largest memory segments left asleep"
    )
    args = ap.parse_args()

    from baton_engine.config import EngineConfig
    from baton_engine.core.engine_core import EngineCore
    from baton_engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=args.model,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enable_sleep_mode=True,
    )
    rows: list[tuple[str, float, tuple[float, float, float], str]] = []
    start = time.perf_counter()
    core = EngineCore(config)
    rows.append(("start an engine", time.perf_counter() - start, memory_gib(args.device), ""))
    vocab = core.model_config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    first = run(core, prompts, params, "a")
    rows.append(("run the requests", time.perf_counter() - start, memory_gib(args.device), ""))
    for level in (int(x) for x in args.levels.split(",")):
        phases = (
            (f"sleep level {level}", core.sleep, level),
            ("wake the weights", core.wake_up, ["weights"]),
            ("wake the KV cache", core.wake_up, ["kv_cache"]),
        )
        for name, phase, arg in phases:
            start = time.perf_counter()
            phase(arg)
            rows.append((name, time.perf_counter() - start, memory_gib(args.device), ""))
            if args.segments and name.startswith("sleep"):
                print_segments()
        start = time.perf_counter()
        again = run(core, prompts, params, f"l{level}")
        same = "same tokens" if again == first else "TOKENS DIFFER"
        rows.append(("run them again", time.perf_counter() - start, memory_gib(args.device), same))
    del core
    gc.collect()
    print(f"model {args.model or 'default'} ({args.load_format}), {args.device}, {args.dtype}")
    print(f"{'phase':<20} {'seconds':>8} {'alloc GiB':>10} {'reserved':>9} {'device':>7}")
    for name, seconds, (alloc, reserved, used), note in rows:
        print(f"{name:<20} {seconds:8.3f} {alloc:10.2f} {reserved:9.2f} {used:7.2f}  {note}")


if __name__ == "__main__":
    main()
