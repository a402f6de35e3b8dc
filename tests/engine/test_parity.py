"""Greedy outputs of the engine equal Hugging Face transformers token for token (float32).

The reference is transformers' own GGUF loading (an independent dequantization path), one prompt
at a time; Baton runs all prompts together with continuous batching and prefix caching, then
again with a pool so small that requests are preempted and recomputed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM, SamplingParams

NUM_NEW_TOKENS = 32

SYSTEM = "You are a helpful assistant who answers briefly and precisely."
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
]
RAW = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans landed on the",
    "Paris is known for the Eiffel Tower, the Louvre museum, and its many cafés. "
    "Every year, millions of tourists visit the city to",
    "A list of prime numbers: 2, 3, 5, 7, 11, 13,",
    "Water boils at",
    # a long one, so that it is chunked and spans many blocks
    " ".join(f"Item {i} is a {c} box." for i, c in enumerate(["red", "blue", "green"] * 12))
    + " The next item is",
]


def build_prompts(tokenizer: Any) -> list[list[int]]:
    prompts = []
    for q in QUESTIONS:  # chat prompts share the system prefix: prefix-cache hits
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            tokenize=False,
            add_generation_prompt=True,
        )
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    prompts += [tokenizer(t).input_ids for t in RAW]
    return prompts


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    return build_prompts(tokenizer)


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]], hf_model: Any) -> list[list[int]]:
    model = hf_model
    outs = []
    # A plain greedy loop: generate() would stop at EOS or, with min_new_tokens, suppress it,
    # while the engine runs with ignore_eos (keep going, suppress nothing).
    with torch.inference_mode():
        for p in prompts:
            out = model(torch.tensor([p]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            while len(tokens) < NUM_NEW_TOKENS:
                out = model(
                    torch.tensor([[tokens[-1]]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
                tokens.append(int(out.logits[0, -1].argmax()))
            outs.append(tokens)
    return outs


def run_baton(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_same(got: list[list[int]], want: list[list[int]]) -> None:
    mismatches = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not mismatches, f"prompts {mismatches} differ, e.g. {got[mismatches[0]]} vs " + str(
        want[mismatches[0]]
    )


@pytest.mark.slow
def test_prompts_cover_the_cases(prompts: list[list[int]]) -> None:
    assert len(prompts) >= 16
    lengths = sorted(map(len, prompts))
    assert lengths[0] < 16 and lengths[-1] > 200  # one block or less, up to many blocks


@pytest.mark.slow
def test_greedy_matches_hf_with_prefix_caching(
    default_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm = LLM(
        str(default_model_dir),
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=256,  # forces chunked prefill of the long prompt
        kv_cache_memory=256 << 20,
    )
    assert_same(run_baton(llm, prompts), reference)
    stats = llm.engine.core.stats()
    assert stats.num_prefix_hits > 0  # the chat prompts shared their system prefix
    # A second pass hits the cache for every full prompt block and still matches.
    assert_same(run_baton(llm, prompts), reference)
    assert llm.engine.core.stats().num_prefix_hits > stats.num_prefix_hits
    llm.engine.core.check_invariants()


@pytest.mark.slow
def test_greedy_matches_hf_under_preemption(
    default_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm = LLM(
        str(default_model_dir),
        dtype="float32",
        max_model_len=384,
        num_gpu_blocks_override=24,  # 384 tokens for 16 requests: most wait or get preempted
        max_num_batched_tokens=512,
    )
    assert_same(run_baton(llm, prompts), reference)
    assert llm.engine.core.stats().num_preemptions > 0
    llm.engine.core.check_invariants()
