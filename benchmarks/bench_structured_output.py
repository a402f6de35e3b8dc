"""What structured output costs: the same batch of requests free and under a JSON schema, and
XGrammar's own parts (compiling a schema, filling a bitmask row, applying a bitmask).

    python benchmarks/bench_structured_output.py [--requests 16] [--max-tokens 64]

Runs on the default model (CPU) in one process: a warm-up, then the free batch and the
constrained batch in turns (``--rounds``). Every request is greedy with ``ignore_eos`` off, so
the free and the constrained batch generate different tokens: compare tokens per second, not
times. Where the bitmask's work runs: the engine fills each constrained request's row on the
host before its step (the request's last token accepted first, so those requests wait for
their tokens instead of running a step ahead), and the sampler applies it to the logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from baton import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]},
    },
    "required": ["name", "age", "hobbies", "city"],
    "additionalProperties": False,
}


def run_batch(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = 0
    if params.structured_outputs is not None:
        for o in outs:
            try:
                json.loads(o.outputs[0].text)
                valid += 1
            except ValueError:
                pass
    return elapsed, tokens, valid


def xgrammar_parts(llm: LLM) -> None:
    import xgrammar as xgr

    manager = llm.engine.core.structured
    schema = dict(SCHEMA, title=f"fresh-{time.time_ns()}")  # not in XGrammar's cache yet
    start = time.perf_counter()
    grammar = manager.grammar(StructuredOutputsParams(json=schema))
    first = time.perf_counter() - start
    start = time.perf_counter()
    manager.grammar(StructuredOutputsParams(json=schema))
    again = time.perf_counter() - start
    print(f"compile a new schema {first * 1e3:.1f} ms, the same again {again * 1e3:.2f} ms")
    from baton_engine.structured_output import apply_bitmask

    n = 200
    mask = xgr.allocate_token_bitmask(1, manager.vocab_size)
    # at the start (one or two tokens allowed), then inside a string value (most are)
    for where, text in (("at the start", ""), ("inside a string", '{"name": "Al')):
        for token in llm.get_tokenizer()(text, add_special_tokens=False).input_ids:
            assert grammar.accept(token)
        begin = time.perf_counter()
        for _ in range(n):
            grammar.fill_bitmask(mask, 0)
        fill = (time.perf_counter() - begin) / n
        masks = manager.bitmask([grammar] * 16)
        allowed = int(sum(bin(w & 0xFFFFFFFF).count("1") for w in masks[0].tolist()))
        logits = torch.randn(16, manager.vocab_size)
        begin = time.perf_counter()
        for _ in range(n):
            apply_bitmask(logits.clone(), masks, range(16))
        apply = (time.perf_counter() - begin) / n
        print(
            f"{where} ({allowed} tokens allowed): fill one row {fill * 1e6:.0f} us, apply to "
            f"16 rows of {manager.vocab_size} logits {apply * 1e6:.0f} us (a clone included)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    llm = LLM(max_model_len=512)
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Describe person number {i} as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.requests)
    ]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    run_batch(llm, prompts, free)  # warm-up: kernels, caches
    run_batch(llm, prompts, constrained)
    rates: dict[str, list[float]] = {"free": [], "json schema": []}
    for _ in range(args.rounds):
        for name, params in (("free", free), ("json schema", constrained)):
            elapsed, tokens, valid = run_batch(llm, prompts, params)
            rates[name].append(tokens / elapsed)
            extra = f", {valid}/{len(prompts)} parse as JSON" if name != "free" else ""
            rate = tokens / elapsed
            print(f"{name:12} {tokens:5} tokens in {elapsed:6.3f} s: {rate:7.1f} tok/s{extra}")
    for name, values in rates.items():
        print(f"{name:12} median {statistics.median(values):7.1f} tok/s over {len(values)} rounds")
    xgrammar_parts(llm)


if __name__ == "__main__":
    main()
