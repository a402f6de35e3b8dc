"""n-gram speculative decoding on a GPU, dummy weights: output tokens per second with ``--k``
drafts against none (each configuration an engine of its own, in this process, one after the
other), greedy, the drafts' acceptance, whether the tokens equal those without drafts, and the
decode graphs' sizes replayed (rows: a step's tokens, drafts included).

A dummy-weight model's greedy output falls into short loops, which its n-grams propose well:
the acceptance is the model's, not a real model's. The table's ``ms/step`` (decode steps of the
run: a step's wall time) tells what a step of 1 + K rows costs next to a step of one row,
whatever the acceptance.

    python benchmarks/device/spec_probe.py --shape qwen --batch 1 --num-prompts 4 --k 0,2,4
    python benchmarks/device/spec_probe.py --shape qwen --batch 1 --num-prompts 4 --sync-drafts
    python benchmarks/device/spec_probe.py --shape tiny --device cpu --batch 1 --num-prompts 2 \
        --prompt-len 32 --output-len 24 --k 0,2                    # a smoke run on CPU
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_engine import probe_args, probe_engine, random_prompts


def main() -> None:
    p = probe_args(__doc__.split("\n\n")[0])
    p.add_argument("--k", default="0,2,4", help="num_speculative_tokens values (0: none)")
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--sync", action="store_true", help="no async scheduling without drafts too")
    p.add_argument("--eager-drafts", action="store_true", help="steps with drafts without graphs")
    p.add_argument(
        "--sync-drafts", action="store_true", help="no async scheduling with drafts (K > 0)"
    )
    args = p.parse_args()
    if args.eager_drafts:
        from baton_engine.runner import model_runner

        model_runner.SPLIT_GRAPHS = False
    args.only_config = ""  # several engines in this process: 0.6 of the memory each
    base: dict[str, list[int]] | None = None
    lookup = f"{args.lookup_min}..{args.lookup_max}"
    print(f"{args.shape}, batch {args.batch}, {args.num_prompts} x ({args.prompt_len} in, "
          f"{args.output_len} out), prompt_lookup {lookup}")  # fmt: skip
    print(f"{'K':>2} {'tok/s':>9} {'x':>6} {'ms/step':>8} {'steps':>6} {'accepted':>9} "
          f"{'same':>5}  graph sizes (steps)")  # fmt: skip
    base_rate = 0.0
    for k in [int(v) for v in args.k.split(",")]:
        spec = None
        if k:
            spec = {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_min": args.lookup_min,
                "prompt_lookup_max": args.lookup_max,
            }
        sync = {"async_scheduling": False} if args.sync else {}
        if args.sync_drafts and k:
            sync = {"async_scheduling": False}
        core, mc, params = probe_engine(args, speculative_config=spec, **sync)
        prompts = random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size)
        # warm-up: the same shapes' kernels and graphs, two short requests
        for i, prompt in enumerate(random_prompts(2, 32, mc.vocab_size, seed=9)):
            core.add_request(f"w{i}", prompt, params)
        while core.has_unfinished_requests():
            core.step()
        sched = core.scheduler
        drafts0, accepted0 = sched.num_draft_tokens, sched.num_accepted_tokens
        graphs = core.runner.graphs
        before = dict(graphs.num_steps) if graphs is not None else {}
        for i, prompt in enumerate(prompts):
            core.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        decode_s, decode_steps = 0.0, 0
        start = time.perf_counter()
        while core.has_unfinished_requests():
            t0 = time.perf_counter()
            # a decode step: every running request past its prompt, none to admit
            full = len(sched.running) == args.batch or not sched.num_waiting
            prompt_step = not full or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
            )
            outs = core.step()
            if not prompt_step:
                decode_s += time.perf_counter() - t0
                decode_steps += 1
            for out in outs:
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        elapsed = time.perf_counter() - start
        n = sum(len(t) for t in tokens.values())
        rate = n / elapsed
        if base is None:
            base, base_rate = tokens, rate
        drafts = sched.num_draft_tokens - drafts0
        accepted = sched.num_accepted_tokens - accepted0
        share = f"{accepted / drafts:.0%}" if drafts else "-"
        sizes = {}
        if graphs is not None:
            sizes = {s: c - before.get(s, 0) for s, c in graphs.num_steps.items()}
            sizes = {s: c for s, c in sorted(sizes.items()) if c}
        ms = 1000 * decode_s / max(decode_steps, 1)
        print(f"{k:>2} {rate:>9.1f} {rate / base_rate:>6.2f} {ms:>8.3f} {decode_steps:>6} "
              f"{share:>9} {tokens == base!s:>5}  {sizes}", flush=True)  # fmt: skip
        del core, graphs, sched  # (each holds the engine: its KV pool and graphs)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
