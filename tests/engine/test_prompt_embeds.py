"""vLLM's prompt embeddings (``enable_prompt_embeds``): a prompt given as the model's input
embeddings generates what the same inputs as tokens would, through chunked prompts, the prefix
cache, preemption and batches that mix both kinds; rows that are no token's embedding generate
what transformers generates from them; bad embeddings are refused in words."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build_model

from baton import LLM, SamplingParams
from baton_engine.errors import InvalidRequestError
from baton_engine.prompt_embeds import row_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves falling on a quiet river at dusk, then explain it.",
    "1, 2, 3, 4,",
]


def _table(llm: LLM) -> torch.Tensor:
    """The model's token embeddings (what Hugging Face's get_input_embeddings() looks up)."""
    return llm.engine.core.runner.model.embed_tokens.weight.detach().clone()


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> Iterator[LLM]:
    # A step budget of 24 tokens: the 40-token prompts run in chunks, one of them a single row.
    engine = LLM(
        str(default_model_dir), dtype="float32", max_model_len=256, enable_prompt_embeds=True,
        max_num_batched_tokens=24, enable_prefix_caching=True,
    )  # fmt: skip
    yield engine
    engine.shutdown()


def test_embeddings_of_tokens_generate_what_the_tokens_do(llm: LLM) -> None:
    """Each prompt as token ids and as its tokens' embeddings (in one batch with prompts of
    the other kind, as vLLM takes them): the same greedy tokens and the same sampled ones of a
    seeded request; an embeddings prompt has no token ids or text; a [1, length, hidden]
    tensor is a batch of one."""
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in TEXTS] + [[(7 * i) % 4000 + 20 for i in range(41)]]
    table = _table(llm)
    by_ids = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY))
    mixed = [{"prompt_embeds": table[p]} if i % 2 else {"prompt_token_ids": p}
             for i, p in enumerate(prompts)]  # fmt: skip
    outs = llm.generate(mixed, GREEDY, use_tqdm=False)
    assert _tokens(outs) == by_ids
    assert outs[1].prompt_token_ids == [] and outs[1].prompt is None
    as_embeds = llm.generate([{"prompt_embeds": table[p][None]} for p in prompts], GREEDY)
    assert _tokens(as_embeds) == by_ids
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    assert _tokens(llm.generate([{"prompt_embeds": table[prompts[1]]}], seeded)) == _tokens(
        llm.generate([{"prompt_token_ids": prompts[1]}], seeded)
    )
    # presence and frequency penalties read only the outputs: the same tokens either way; a
    # repetition penalty finds no prompt tokens in an embeddings prompt
    penalized = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=1.5,
        frequency_penalty=0.5, repetition_penalty=1.3,
    )  # fmt: skip
    outputs_only = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=1.5,
        frequency_penalty=0.5,
    )  # fmt: skip
    got = llm.generate([{"prompt_embeds": table[prompts[3]]}], penalized)[0].outputs[0]
    assert len(got.token_ids) == 16
    assert _tokens(llm.generate([{"prompt_embeds": table[prompts[3]]}], outputs_only)) == _tokens(
        llm.generate([{"prompt_token_ids": prompts[3]}], outputs_only)
    )


def test_equal_embeddings_share_the_prefix_cache(llm: LLM) -> None:
    """A 40-row prompt computed once: the same rows again hit 32 cached positions (two
    blocks), the same tokens as ids none (their blocks are hashed from the rows), rows that
    differ in one value after the first block only the first block; each generates what it
    would alone."""
    table = _table(llm)
    ids = [(11 * i) % 3000 + 50 for i in range(40)]
    first = llm.generate([{"prompt_embeds": table[ids]}], GREEDY, use_tqdm=False)[0]
    again = llm.generate([{"prompt_embeds": table[ids]}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    changed = table[ids]
    changed[20, 5] += 0.25
    other = llm.generate([{"prompt_embeds": changed}], GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 16
    as_ids = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    assert as_ids.num_cached_tokens == 0
    assert as_ids.outputs[0].token_ids == first.outputs[0].token_ids
    rows = row_ids(table[ids])
    assert all(r < 0 for r in rows) and len(set(rows)) == len(set(ids))


def test_preempted_embeddings_prompts_are_computed_again(default_model_dir: Path) -> None:
    """A pool of 6 blocks for 4 requests of 2-3 blocks each: requests are preempted and their
    prompts, embeddings, computed again; each output is still what it is alone."""
    engine = LLM(
        str(default_model_dir), dtype="float32", max_model_len=64, num_gpu_blocks_override=6,
        enable_prompt_embeds=True,
    )  # fmt: skip
    try:
        table = _table(engine)
        prompts = [[(13 * i + 7 * k) % 5000 + 30 for i in range(20 + 3 * k)] for k in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        alone = [_tokens(engine.generate([{"prompt_token_ids": p}], params))[0] for p in prompts]
        assert engine.engine.core.stats().num_preemptions == 0
        outs = engine.generate([{"prompt_embeds": table[p]} for p in prompts], params)
        assert engine.engine.core.stats().num_preemptions > 0
        assert _tokens(outs) == alone
    finally:
        engine.shutdown()


def test_bad_embeddings_are_refused(llm: LLM, default_model_dir: Path) -> None:
    """Refused in words, before anything is queued: another hidden size, an integer tensor,
    no rows, a list, prompt logprobs (vLLM's words), embedding requests; and any embeddings by
    an engine without ``enable_prompt_embeds``."""
    hidden = llm.engine.core.model_config.hidden_size
    cases = [
        (torch.randn(4, hidden + 1), GREEDY, r"shape \[prompt length, 576\].*\[4, 577\]"),
        (torch.ones(4, hidden, dtype=torch.int64), GREEDY, "dtype int64 are not supported"),
        (torch.randn(0, hidden), GREEDY, "the prompt is empty"),
        ([[0.0] * hidden], GREEDY, "must be a torch.Tensor, got list"),
        (torch.randn(4, hidden), SamplingParams(prompt_logprobs=1), "not compatible"),
    ]
    for embeds, params, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate([{"prompt_embeds": embeds}], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="for generate"):
        llm.embed([{"prompt_embeds": torch.randn(4, hidden)}])
    off = LLM(str(default_model_dir), max_model_len=64)
    try:
        with pytest.raises(InvalidRequestError, match="--enable-prompt-embeds"):
            off.generate([{"prompt_embeds": torch.randn(4, hidden)}], GREEDY, use_tqdm=False)
    finally:
        off.shutdown()


@pytest.mark.parametrize("name", ["llama", "granite", "gemma", "gemma2", "gemma3"])
def test_embeddings_generate_what_transformers_does_from_them(
    name: str, default_model_dir: Path, tmp_path: Path
) -> None:
    """Rows that are no token's embedding (a token's, shifted) generate what transformers'
    ``generate(inputs_embeds=...)`` does: Granite's multiplier scales them; Gemma's
    sqrt(hidden) is in its table's lookup (its rows come scaled)."""
    model = build_model(name, default_model_dir, tmp_path)
    ids = torch.tensor([[10 + 3 * i for i in range(21)]])
    with torch.inference_mode():
        rows = model.get_input_embeddings()(ids)[0]
        noise = torch.randn(rows.shape, generator=torch.Generator().manual_seed(0))
        rows = rows + 0.5 * rows.std() * noise
        want = model.generate(
            inputs_embeds=rows[None], attention_mask=torch.ones_like(ids), max_new_tokens=10,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0].tolist()  # fmt: skip
    engine = LLM(str(tmp_path), dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
                 enable_prompt_embeds=True)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        got = engine.generate([{"prompt_embeds": rows}], params, use_tqdm=False)
        tokens = engine.generate([{"prompt_token_ids": ids[0].tolist()}], params, use_tqdm=False)
    finally:
        engine.shutdown()
    assert list(got[0].outputs[0].token_ids) == want
    assert got[0].outputs[0].token_ids != tokens[0].outputs[0].token_ids  # (other inputs)


@pytest.mark.parametrize(
    "engine_args",
    [
        {"async_scheduling": True},
        {"num_scheduler_steps": 4},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 3, "prompt_lookup_min": 1}},
    ],
    ids=["async", "multi-step", "ngram"],
)  # fmt: skip
def test_embeddings_prompts_under_each_schedule(
    engine_args: dict[str, Any], default_model_dir: Path
) -> None:
    """Scheduled ahead of their tokens (async), with decodes of several passes a step, or
    beside requests that speculate (an embeddings prompt speculates no drafts): the tokens'
    outputs, for prompts of 1 to 41 rows in chunks of a 24-token budget (a last chunk of one
    row runs no multi-step pass: its input is a row, not a token)."""
    engine = LLM(
        str(default_model_dir), dtype="float32", max_model_len=256, enable_prompt_embeds=True,
        max_num_batched_tokens=24, **engine_args,
    )  # fmt: skip
    try:
        table = _table(engine)
        prompts = [[(7 * i + 3 * k) % 4000 + 20 for i in range(n)]
                   for k, n in enumerate((1, 5, 23, 41, 16))]  # fmt: skip
        prompts.append([5, 6, 7] * 4)  # (its n-grams repeat: drafts for the token prompt)
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        want = _tokens(engine.generate([{"prompt_token_ids": p} for p in prompts], params))
        mixed = [{"prompt_embeds": table[p]} if i % 2 == 0 else {"prompt_token_ids": p}
                 for i, p in enumerate(prompts)]  # fmt: skip
        assert _tokens(engine.generate(mixed, params, use_tqdm=False)) == want
        drafts = engine.engine.core.stats().num_draft_tokens
        every = [{"prompt_embeds": table[p]} for p in prompts]
        assert _tokens(engine.generate(every, params, use_tqdm=False)) == want
        assert engine.engine.core.stats().num_draft_tokens == drafts
        # alone, 25 rows: its last row is computed alone, the only running request
        alone = [(5 * i) % 3000 + 40 for i in range(25)]
        want = _tokens(engine.generate([{"prompt_token_ids": alone}], params, use_tqdm=False))
        got = engine.generate([{"prompt_embeds": table[alone]}], params, use_tqdm=False)
        assert _tokens(got) == want
    finally:
        engine.shutdown()


def test_the_engine_takes_vllms_prompt_dicts(llm: LLM) -> None:
    """``LLMEngine.add_request`` takes vLLM's prompt dicts (text, token ids, embeddings, with
    a cache salt) as ``LLM.generate`` does: the same tokens as the plain forms; a dict of
    nothing it knows is refused in words."""
    engine = llm.engine
    ids = llm.get_tokenizer().encode(TEXTS[1])
    forms = {
        "text": TEXTS[1],
        "ids": ids,
        "text-dict": {"prompt": TEXTS[1]},
        "ids-dict": {"prompt_token_ids": ids, "cache_salt": "tenant-a"},
        "embeds-dict": {"prompt_embeds": _table(llm)[ids]},
    }
    for req_id, prompt in forms.items():
        engine.add_request(req_id, prompt, GREEDY)
    outs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    tokens = {k: list(o.outputs[0].token_ids) for k, o in outs.items()}
    assert len(tokens) == len(forms) and len(set(map(tuple, tokens.values()))) == 1, tokens
    assert outs["text-dict"].prompt == TEXTS[1] and outs["ids-dict"].prompt_token_ids == ids
    for bad, message in (
        ({"text": "x"}, "prompts with text are not supported"),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt must be a non-empty string"),
        ({"prompt_embeds": [1.0]}, "must be a torch.Tensor"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request("bad", bad, GREEDY)
    assert not engine.has_unfinished_requests()
