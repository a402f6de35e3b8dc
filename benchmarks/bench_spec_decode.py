"""n-gram speculative decoding against plain decoding, offline, on the default model (or any).

Two workloads of chat prompts, greedy: "copy" asks the model to reproduce, then edit, a block of
code given in the prompt (the case prompt lookup is for: its output repeats its input), "open"
asks open questions (drafts rarely hold: what speculation costs when it does not pay). Each
configuration (no drafts, then ``--k`` drafts each) runs every workload at ``--batch`` requests
at a time, in a fresh engine, after one warm-up pass; the table gives output tokens per second,
the speed-up over no drafts, the drafts' acceptance and whether the greedy tokens equal those
without drafts.

    python benchmarks/bench_spec_decode.py                      # batch 1, K = 2 and 4
    python benchmarks/bench_spec_decode.py --batch 8 --k 3
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

CODE = [
    '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals."""
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
''',
    """class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key, value):
        self.items.pop(key, None)
        self.items[key] = value
        if len(self.items) > self.capacity:
            self.items.pop(next(iter(self.items)))
""",
    """def word_counts(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.lower().split():
                word = word.strip(".,;:!?")
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])
""",
    """def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1
""",
]
ASKS = [
    "Copy this code exactly as it is, in a Python code block.",
    "Rewrite this code with a docstring and type hints, keeping the body the same.",
]
OPEN = [
    "Why is the sky blue?",
    "Give three tips for learning a new language.",
    "What makes a good cup of coffee?",
    "Describe a day at the beach.",
    "How do airplanes stay in the air?",
    "What are the benefits of regular exercise?",
    "Explain what a computer program is to a child.",
    "Write a short poem about autumn.",
]


def workloads() -> dict[str, list[list[dict[str, str]]]]:
    copy = [[{"role": "user", "content": f"{ask}\n\n{code}"}] for code in CODE for ask in ASKS]
    return {"copy": copy, "open": [[{"role": "user", "content": q}] for q in OPEN]}


def run(
    model: str | None, k: int, args: argparse.Namespace
) -> dict[str, tuple[float, int, int, int, list[list[int]]]]:
    """Per workload: seconds, output tokens, drafts proposed, drafts accepted, the tokens."""
    from baton_engine.llm import LLM
    from baton_engine.sampling_params import SamplingParams

    spec = None
    if k:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
        }
    llm = LLM(model, max_num_seqs=args.batch, speculative_config=spec, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    sched = llm.engine.core.scheduler
    out: dict[str, tuple[float, int, int, int, list[list[int]]]] = {}
    llm.chat(workloads()["open"][:2], params, use_tqdm=False)  # warm-up
    for name, prompts in workloads().items():
        drafts0, accepted0 = sched.num_draft_tokens, sched.num_accepted_tokens
        start = time.perf_counter()
        results = llm.chat(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(r.outputs[0].token_ids) for r in results]
        out[name] = (
            seconds,
            sum(len(t) for t in tokens),
            sched.num_draft_tokens - drafts0,
            sched.num_accepted_tokens - accepted0,
            tokens,
        )
    del llm
    gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, default=1, help="requests at a time (max_num_seqs)")
    parser.add_argument("--k", default="2,4", help="num_speculative_tokens values, comma-separated")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    ks = [0] + [int(k) for k in args.k.split(",")]
    results: dict[int, Any] = {k: run(args.model, k, args) for k in ks}
    print(f"batch {args.batch}, max_tokens {args.max_tokens}, prompt_lookup "
          f"{args.lookup_min}..{args.lookup_max}")  # fmt: skip
    print(f"{'workload':<8} {'K':>2} {'tok/s':>8} {'x':>6} {'drafts':>7} {'accepted':>9} "
          f"{'same tokens':>12}")  # fmt: skip
    for name in workloads():
        base_s, base_n, _, _, base_tokens = results[0][name]
        for k in ks:
            seconds, n, drafts, accepted, tokens = results[k][name]
            rate = n / seconds
            share = f"{accepted / drafts:.0%}" if drafts else "-"
            print(f"{name:<8} {k:>2} {rate:>8.1f} {rate / (base_n / base_s):>6.2f} {drafts:>7} "
                  f"{share:>9} {tokens == base_tokens!s:>12}")  # fmt: skip


if __name__ == "__main__":
    main()
