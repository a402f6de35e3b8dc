"""Tensor parallelism on a multi-GPU host (issue 6): one shape of issue 5's workload on
``--tp`` GPUs, dummy weights, bf16, the engine alone in this process.

    python benchmarks/device/tp_probe.py --shape llama --tp 2 [--num-prompts 64] [--batch 64]
        [--prompt-len 512] [--output-len 256]

``--shape llama70b`` is Llama-3.1-70B's shape (140 GB of bf16 weights: more than one H200
holds). Prints the KV cache each rank got (blocks, tokens), the load time, output tokens/s of
the whole run, the prompt phase and the median decode step.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu_engine import probe_args, probe_engine, random_prompts, run_all, warm_up


def main() -> int:
    p = probe_args(__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = p.parse_args()
    start = time.perf_counter()
    core, mc, params = probe_engine(
        args, tensor_parallel_size=args.tp, enforce_eager=args.enforce_eager
    )
    loaded = time.perf_counter() - start
    try:
        blocks = core.kv.pool.num_blocks
        warm_up(core, mc, params)
        prompts = random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size)
        run = run_all(core, prompts, params)
    finally:
        core.shutdown()
    steps = [dt for _, dt in run["decode_steps"]]
    out_tokens = sum(len(t) for t in run["tokens"].values())
    print(
        f"{args.shape} tp={args.tp}{' eager' if args.enforce_eager else ''}: KV {blocks} "
        f"blocks ({blocks * core.config.block_size} tokens), loaded in {loaded:.1f} s; "
        f"{args.num_prompts} x {args.prompt_len} -> "
        f"{args.output_len}: {out_tokens / run['elapsed']:,.0f} output tok/s "
        f"({run['elapsed']:.2f} s, first token at {run['first_token']:.2f} s, median decode "
        f"step {1000 * statistics.median(steps) if steps else 0:.2f} ms)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
