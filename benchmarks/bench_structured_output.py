"""What structured output costs: the same batch of requests free and under a JSON schema, and
XGrammar's own parts (compiling a schema, filling a bitmask row, applying a bitmask).

    python benchmarks/bench_structured_output.py [--requests 16] [--max-tokens 64]
    python benchmarks/bench_structured_output.py --model DIR --device cuda --load-format dummy \
        --requests 256 --max-tokens 128 --free-ignore-eos   # a GPU, random weights

Runs on the default model (CPU) in one process: a warm-up, then the free batch and the
constrained batch in turns (``--rounds``). Every request is greedy with ``ignore_eos`` off
(``--free-ignore-eos``: on for the free batch, whose random-weight model may end early), so
the free and the constrained batch generate different tokens: compare tokens per second, not
times. ``--rows`` times XGrammar's host work for that many constrained requests in a step:
filling their bitmask rows one by one and with its threads, and accepting their tokens.
``--phases`` then runs one free and one constrained batch with wall-clock timers around the
engine's step and its parts, and prints each part's milliseconds per step: where a constrained
step's time goes (on a GPU, ``launch`` is the host's part only; the wait for the device shows
in ``finish in-flight``, which also accepts the tokens).

Where the bitmask's work runs: the engine fills each constrained request's row on the host
before its step (the request's last token accepted first, so those requests wait for
their tokens instead of running a step ahead), and the sampler applies it to the logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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


def _matcher(grammar: object) -> object:
    """The grammar's XGrammar matcher (``_matcher`` before it was public)."""
    return getattr(grammar, "matcher", None) or grammar._matcher  # type: ignore[attr-defined]


def host_rows(llm: LLM, rows: int) -> None:
    """A step's grammar work on the host for ``rows`` requests, each at a different place of
    the schema: filling the bitmask one row after another (what the engine does) against
    XGrammar's BatchGrammarMatcher threads, and accepting one token each."""
    import os

    import xgrammar as xgr

    manager = llm.engine.core.structured
    tok = llm.get_tokenizer()
    texts = ['{"name": "Al', '{"name": "Al", "age": 3', '{"name": "B", "age": 7, "hobbies": ["c']
    grammars = []
    for i in range(rows):
        grammar = manager.grammar(StructuredOutputsParams(json=SCHEMA))
        assert _matcher(grammar).accept_string(texts[i % len(texts)])
        grammars.append(grammar)
    matchers = [_matcher(g) for g in grammars]
    mask = xgr.allocate_token_bitmask(rows, manager.vocab_size)
    n = 50

    def timed(fill: object) -> float:
        begin = time.perf_counter()
        for _ in range(n):
            fill()  # type: ignore[operator]
        return (time.perf_counter() - begin) / n * 1e3

    one_by_one = timed(lambda: [g.fill_bitmask(mask, i) for i, g in enumerate(grammars)])
    parts = [f"one by one {one_by_one:.3f} ms"]
    for threads in sorted({2, 4, 8, 16, os.cpu_count() or 1}):
        batch = xgr.BatchGrammarMatcher(threads)
        ms = timed(lambda b=batch: b.batch_fill_next_token_bitmask(matchers, mask))
        parts.append(f"{threads} threads {ms:.3f} ms")
    print(f"fill {rows} rows ({os.cpu_count()} cores): " + ", ".join(parts))
    # Accepting a token each (a digit where every request is inside a string or a number),
    # then rolling back, n times.
    digit = tok("7", add_special_tokens=False).input_ids[-1]
    begin = time.perf_counter()
    for _ in range(n):
        for m in matchers:
            m.accept_token(digit)
        for m in matchers:
            m.rollback(1)
    accept = (time.perf_counter() - begin) / n * 1e3
    print(f"accept a token in {rows} matchers (and roll it back): {accept:.3f} ms")


@contextmanager
def phase_timers(llm: LLM) -> Iterator[dict[str, float]]:
    """Wall-clock seconds spent in the engine's step and its parts while inside, by name (an
    instance attribute shadows each method; each is put back on exit)."""
    core = llm.engine.core
    times: dict[str, float] = defaultdict(float)
    patched: list[tuple[Any, str, Any]] = []

    def wrap(obj: Any, name: str, label: str) -> None:
        fn: Callable[..., Any] = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[label] += time.perf_counter() - start
                times[label + " calls"] += 1

        patched.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, timed)

    wrap(core, "step", "step")
    wrap(core.scheduler, "schedule", "schedule")
    wrap(core, "_finish_in_flight", "finish in-flight")
    wrap(core, "_grammar_bitmask", "fill bitmask")
    wrap(core.runner, "launch", "launch")
    wrap(core.runner.batch, "update", "batch update")
    wrap(core.runner, "_run_decode_graph", "decode graph")
    wrap(core.runner, "_sampling_metadata", "metadata")
    wrap(core.runner, "sampler", "sampler")
    try:
        yield times
    finally:
        for obj, name, own in reversed(patched):
            if own is None:
                delattr(obj, name)  # the class's method shows again
            else:
                setattr(obj, name, own)


def phases(llm: LLM, prompts: list[str], runs: dict[str, SamplingParams]) -> None:
    labels = ["step", "schedule", "finish in-flight", "fill bitmask", "launch"]
    # the parts of launch
    labels += ["batch update", "decode graph", "metadata", "sampler"]
    print(f"{'ms per step':12}" + "".join(f"{name:>17}" for name in labels) + f"{'steps':>6}")
    for name, params in runs.items():
        with phase_timers(llm) as times:
            run_batch(llm, prompts, params)
        steps = times["step calls"]
        cells = "".join(f"{times[label] / steps * 1e3:17.3f}" for label in labels)
        print(f"{name:12}{cells}{int(steps):6}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-format", default="auto", help="auto, or dummy (random weights)")
    p.add_argument("--free-ignore-eos", action="store_true", help="the free batch ignores EOS")
    p.add_argument("--rows", type=int, default=256, help="rows of the host-work timing")
    p.add_argument("--phases", action="store_true", help="time the engine's step by part")
    args = p.parse_args()
    llm = LLM(
        args.model,
        max_model_len=512,
        device=args.device,
        load_format=args.load_format,
        max_num_seqs=max(args.requests, 1),
    )
    threads = getattr(llm.engine.core.structured, "fill_threads", 1)  # 1 before it existed
    print(f"bitmask fill threads: {threads}")
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Describe person number {i} as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.requests)
    ]
    free = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.free_ignore_eos
    )
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
    host_rows(llm, args.rows)
    if args.phases:
        phases(llm, prompts, {"free": free, "json schema": constrained})


if __name__ == "__main__":
    main()
