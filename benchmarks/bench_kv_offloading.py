"""The host KV tier (``--kv-offloading-size``) against computing evicted prefixes again.

``--convs`` conversations each have a long context of ``--context`` random tokens of their own.
Round 1 sends each context with a first question; round 2 comes back to each, in the same order,
with a second question. The contexts together outgrow the KV pool (``--blocks``), so by round 2
the pool has evicted most of them: without a tier each is computed again, with one its blocks
are copied back from host memory. Every request runs alone and asks for one token, so its time
is its time to first token offline (round 1's mean is printed too: there the tier only costs,
the copies of the blocks the pool evicts). Each configuration is a fresh engine (the same seed, so
dummy weights are equal): the pool alone, the pool with a tier of ``--offload-gib``, and a pool
large enough for every context (the bound: every prefix found on the device).

    python benchmarks/bench_kv_offloading.py                          # the default model, CPU
    python benchmarks/bench_kv_offloading.py --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --device cuda --context 4096 --convs 16 --blocks 2048 --offload-gib 16
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any


def run(args: argparse.Namespace, num_blocks: int, offload_gib: float | None) -> dict[str, Any]:
    from baton_engine.config import EngineConfig
    from baton_engine.core.engine_core import EngineCore
    from baton_engine.sampling_params import SamplingParams

    core = EngineCore(
        EngineConfig(
            model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
            max_model_len=args.context + 64, num_gpu_blocks_override=num_blocks,
            kv_offloading_size=offload_gib, seed=0,
        )
    )  # fmt: skip
    try:
        vocab = core.model_config.vocab_size
        rng = random.Random(0)
        contexts = [[rng.randrange(100, vocab) for _ in range(args.context)]]
        contexts += [[rng.randrange(100, vocab) for _ in range(args.context)]
                     for _ in range(args.convs)]  # fmt: skip
        question = [[rng.randrange(100, vocab) for _ in range(16)] for _ in range(2)]
        params = SamplingParams(temperature=0.0, max_tokens=1)
        count = iter(range(1 << 30))

        def ask(tokens: list[int]) -> tuple[float, int]:
            """The request alone: seconds to its (only) token, and the token."""
            req_id = f"q{next(count)}"
            start = time.perf_counter()
            core.add_request(req_id, tokens, params)
            got: list[int] = []
            while core.has_unfinished_requests():
                for out in core.step():
                    got += out.new_token_ids
            return time.perf_counter() - start, got[0]

        ask(contexts[0] + question[0])  # warm-up (a context of its own)
        first = [ask(context + question[0])[0] for context in contexts[1:]]
        pool_hits, host_hits = core.kv.num_prefix_hits, core.kv.num_host_hits
        second = [ask(context + question[1]) for context in contexts[1:]]
        times = [t for t, _ in second]
        return {
            "first_mean_ms": 1e3 * statistics.fmean(first),
            "ttft_mean_ms": 1e3 * statistics.fmean(times),
            "ttft_p50_ms": 1e3 * statistics.median(times),
            "round_s": sum(times),
            "pool_hits": core.kv.num_prefix_hits - pool_hits,
            "host_hits": core.kv.num_host_hits - host_hits,
            "tokens": [t for _, t in second],
            "prompt": args.context + 16,
        }
    finally:
        core.shutdown()


def release(device: str) -> None:
    """An engine's memory back before the next one sizes its pool."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=2048, help="tokens of each context")
    p.add_argument("--convs", type=int, default=8)
    p.add_argument("--blocks", type=int, default=384, help="KV pool blocks (16 tokens)")
    p.add_argument("--offload-gib", type=float, default=2.0)
    args = p.parse_args()
    everything = (args.convs + 2) * (args.context + 64) // 16 + 64
    configs = [
        ("pool only", args.blocks, None),
        (f"pool + {args.offload_gib:g} GiB tier", args.blocks, args.offload_gib),
        ("pool holding all", everything, None),
    ]
    rows = []
    for name, blocks, gib in configs:
        rows.append((name, blocks, run(args, blocks, gib)))
        release(args.device)
    reference = rows[-1][2]["tokens"]
    print(f"{args.convs} conversations of {args.context}-token contexts; round 2, one request "
          f"at a time ({rows[0][2]['prompt']} prompt tokens each):")  # fmt: skip
    print("| configuration | pool blocks | round 1 TTFT mean ms | TTFT mean ms | TTFT p50 ms | "
          "round 2 s | tokens found (pool / tier) | first tokens as the full pool's |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, blocks, r in rows:
        print(
            f"| {name} | {blocks} | {r['first_mean_ms']:.1f} | {r['ttft_mean_ms']:.1f} | "
            f"{r['ttft_p50_ms']:.1f} | "
            f"{r['round_s']:.2f} | {r['pool_hits']} / {r['host_hits']} | "
            f"{sum(a == b for a, b in zip(r['tokens'], reference, strict=True))}/{args.convs} |"
        )


if __name__ == "__main__":
    main()
