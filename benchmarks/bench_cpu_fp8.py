"""FP8 on the CPU: the default model's offline decode throughput with the model's own KV cache
and layers, with an FP8 KV cache (``--kv-cache-dtype fp8``: the C++ attention kernels widen
its values as they read them), and with FP8 layers (``--quantization fp8``:
torch's CPU ``_scaled_mm``). Each variant one engine in this process, after a short warm-up.

    python benchmarks/bench_cpu_fp8.py [--dtype bfloat16] [--num-prompts 16] [--output-len 64]
"""

from __future__ import annotations

import argparse
import time

from baton import LLM, SamplingParams

VARIANTS = {
    "model's cache and layers": {},
    "FP8 KV cache": {"kv_cache_dtype": "fp8"},
    "FP8 layers": {"quantization": "fp8"},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    prompts = [f"Write a story about the number {i}." for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for name, settings in VARIANTS.items():
        llm = LLM(dtype=args.dtype, max_model_len=512, kv_cache_memory=256 << 20, **settings)
        try:
            llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            runner = llm.engine.core.runner
            print(
                f"{name:26} backend {runner.backend.name:6} {runner.dtype!s:15} "
                f"{args.num_prompts * args.output_len / seconds:8.1f} output tok/s"
            )
        finally:
            llm.shutdown()


if __name__ == "__main__":
    main()
