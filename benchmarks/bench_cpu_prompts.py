"""Prompt (prefill) throughput on the CPU with the CPU attention backend's prompts in its C++
tiles against torch's SDPA (what it does on CPUs with AMX, ``SDPA_PROMPTS_ON_AMX``): the default
model in bf16, prompts of random token ids and one output token each, both settings alternating
in one engine for ``--rounds`` rounds.

    python benchmarks/bench_cpu_prompts.py [--input-len 1024] [--num-prompts 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import time

from baton import LLM, SamplingParams
from baton_engine.llm import TokensPrompt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    llm = LLM(dtype="bfloat16", max_model_len=args.input_len + 16, enable_prefix_caching=False)
    backend = llm.engine.core.runner.backend
    assert backend.name == "cpu", backend.name
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    try:
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
        for r in range(args.rounds):
            for sdpa in (False, True):
                backend.sdpa_prompts = sdpa
                prompts = [
                    TokensPrompt(prompt_token_ids=[rng.randrange(100, 40000)
                                                   for _ in range(args.input_len)])
                    for _ in range(args.num_prompts)
                ]  # fmt: skip
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = args.num_prompts * args.input_len
                print(
                    f"round {r}: prompts in {'SDPA ' if sdpa else 'tiles'} "
                    f"{tokens / seconds:8.1f} prompt tok/s ({seconds:.2f} s)"
                )
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
