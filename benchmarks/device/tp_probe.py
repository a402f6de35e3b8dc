"""Tensor parallelism on a multi-GPU host (issue 6): one shape of issue 5's workload on
``--tp`` GPUs, dummy weights, bf16, the engine alone in this process.

    python benchmarks/device/tp_probe.py --shape llama --tp 2 [--num-prompts 64] [--batch 64]
        [--prompt-len 512] [--output-len 256]

``--shape llama70b`` is Llama-3.1-70B's shape (140 GB of bf16 weights: more than one H200
holds). ``--blocks N`` fixes the KV pool (a tiny shape on a whole H200 would get tens of
millions of blocks). With ``TP_PROBE_DUMP_S=S`` every rank prints all its threads' stacks every
S seconds (what a hang waits on). Prints the KV cache each rank got (blocks, tokens), the load
time, output tokens/s of the whole run, the first token and the median decode step, then how
long the shutdown took.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu_engine import probe_args, probe_engine, random_prompts, run_all, warm_up

# At module level, so that the helper ranks (spawned: they import this module too) also log
# their start-up phases and, with TP_PROBE_DUMP_S set, print every thread's stack that often.
logging.basicConfig(
    level=logging.INFO, format="%(asctime)s %(processName)s %(name)s: %(message)s", force=True
)
if os.environ.get("TP_PROBE_DUMP_S"):
    faulthandler.dump_traceback_later(float(os.environ["TP_PROBE_DUMP_S"]), repeat=True)


def main() -> int:
    p = probe_args(__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--blocks", type=int, help="num_gpu_blocks_override (tiny shapes)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = p.parse_args()
    start = time.perf_counter()
    extra = {} if args.blocks is None else {"num_gpu_blocks_override": args.blocks}
    core, mc, params = probe_engine(
        args,
        tensor_parallel_size=args.tp,
        enforce_eager=args.enforce_eager,
        max_num_batched_tokens=args.max_num_batched_tokens,
        **extra,
    )
    loaded = time.perf_counter() - start
    try:
        blocks = core.kv.pool.num_blocks
        warm_up(core, mc, params)
        prompts = random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size)
        run = run_all(core, prompts, params)
        steps = [dt for _, dt in run["decode_steps"]]
        out_tokens = sum(len(t) for t in run["tokens"].values())
        print(
            f"{args.shape} tp={args.tp}{' eager' if args.enforce_eager else ''}: KV {blocks} "
            f"blocks ({blocks * core.config.block_size} tokens), loaded in {loaded:.1f} s; "
            f"{args.num_prompts} x {args.prompt_len} -> "
            f"{args.output_len}: {out_tokens / run['elapsed']:,.0f} output tok/s "
            f"({run['elapsed']:.2f} s, first token at {run['first_token']:.2f} s, median "
            f"decode step {1000 * statistics.median(steps) if steps else 0:.2f} ms)",
            flush=True,
        )
    finally:
        start = time.perf_counter()
        core.shutdown()
        print(f"shut down in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
