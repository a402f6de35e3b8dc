"""The offline API on the default model: what a vLLM user relies on, and clear errors for bad
input that leave the engine serving."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton_engine.errors import InvalidRequestError, ModelLoadError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return LLM(str(default_model_dir), max_model_len=256, kv_cache_memory=128 << 20)


def test_default_model_answers(llm: LLM) -> None:
    # Not "What is the capital of France?": its first token is a near-tie in float32 ("The"
    # ahead of "L" by 0.08 logprob), which bf16 rounding resolves either way depending on the
    # order of additions in a GEMM (benchmarks/RESULTS.md, sixth session).
    out = llm.chat([{"role": "user", "content": "Name the capital of France."}], GREEDY)
    completion = out[0].outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason in ("stop", "length")
    assert completion.token_ids


def test_prompt_forms_and_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    text = "The capital of France is"
    by_text, by_ids = llm.generate(
        [text, {"prompt_token_ids": tok(text).input_ids}], GREEDY, use_tqdm=False
    )
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == tok.decode(by_text.outputs[0].token_ids)


def test_max_tokens_and_length_finish(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    (out,) = llm.generate(["Count: one, two,"], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"


def test_generation_config_gives_the_default_sampling_params(
    default_model_dir: Path, llm: LLM
) -> None:
    """As in vLLM, generate() without sampling params uses the model's generation config
    (here overridden: greedy, 6 tokens); without one, SamplingParams' defaults."""
    assert llm.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
    tuned = LLM(
        str(default_model_dir),
        max_model_len=256,
        kv_cache_memory=64 << 20,
        override_generation_config={"temperature": 0.0, "max_new_tokens": 6},
    )
    prompt = "Once upon a time, in a land far away, there lived a dragon who"
    (by_default,) = tuned.generate([prompt], use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    (explicit,) = llm.generate([prompt], greedy, use_tqdm=False)
    assert len(by_default.outputs[0].token_ids) == 6
    assert by_default.outputs[0].token_ids == explicit.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="temperature"):
        LLM(str(default_model_dir), override_generation_config={"temperature": -1})


def test_stop_string_is_not_emitted(llm: LLM) -> None:
    (free,) = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    text = free.outputs[0].text  # " Paris.\n\nThe answer is:"
    stop = text[3:6]
    (out,) = llm.generate(
        ["The capital of France is"],
        SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]),
        use_tqdm=False,
    )
    assert out.outputs[0].text == text[: text.index(stop)]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    (free,) = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    first = free.outputs[0].token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first])
    (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    assert out.outputs[0].token_ids == [first]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == first
    # min_tokens suppresses the stop token until it is reached
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first], min_tokens=3)
    (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 3
    assert first not in out.outputs[0].token_ids[:2]


def test_n_siblings_share_the_prompt(llm: LLM) -> None:
    before = llm.engine.core.stats().num_prefix_hits
    prompt = "Tell me a short story about a dragon who learns to paint. " * 3
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # siblings differ
    assert llm.engine.core.stats().num_prefix_hits > before  # and shared prompt blocks
    (again,) = llm.generate([prompt], params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_seeded_sampling_does_not_depend_on_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=10)
    (alone,) = llm.generate(["My favourite food is"], seeded, use_tqdm=False)
    noise = SamplingParams(temperature=1.0, max_tokens=10)
    batch = llm.generate(
        ["Hello", "My favourite food is", "The weather today"],
        [noise, seeded, noise],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_logprobs(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)
    (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in entry and entry[token_id].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
    )


def test_logit_bias_and_allowed_token_ids(llm: LLM) -> None:
    """OpenAI's logit_bias (+100 forces a token, -100 bans one) and vLLM's allowed_token_ids
    reshape greedy decoding; ids outside the vocabulary are clear errors."""
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    base = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (plain,) = llm.generate([prompt], base, use_tqdm=False)
    plain_ids = plain.outputs[0].token_ids
    banana = tok(" banana", add_special_tokens=False).input_ids[0]
    forced = replace(base, logit_bias={banana: 100.0})
    banned = replace(base, logit_bias={plain_ids[0]: -100.0})
    allowed = [plain_ids[1], banana]
    only = replace(base, allowed_token_ids=allowed)
    outs = llm.generate([prompt] * 3, [forced, banned, only], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [banana] * 6
    assert outs[1].outputs[0].token_ids[0] != plain_ids[0]
    assert set(outs[2].outputs[0].token_ids) <= set(allowed)
    for params, match in (
        (replace(base, logit_bias={10**7: 1.0}), "logit_bias token id"),
        (replace(base, allowed_token_ids=[1, 10**7]), "allowed_token_ids token id"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate([prompt], params, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        SamplingParams(allowed_token_ids=[])


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", GREEDY, "empty"),
        ("word " * 300, GREEDY, "max_model_len"),
        ({"prompt_token_ids": [1, 2, 10**9]}, GREEDY, "out of range"),
    ],
)
def test_bad_prompts_raise_clear_errors(
    llm: LLM, prompt: object, params: SamplingParams, match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([prompt], params, use_tqdm=False)  # type: ignore[list-item]
    assert not llm.engine.has_unfinished_requests()  # nothing left half-submitted
    assert llm.generate(["Hi"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"n": 0},
        {"logprobs": 99},
    ],
)
def test_bad_sampling_params(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_unknown_model_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    with pytest.raises(ModelLoadError, match=r"broken\.gguf"):
        LLM(str(bad))


def test_unknown_engine_argument() -> None:
    with pytest.raises(InvalidRequestError, match="max_num_sequences"):
        LLM(max_num_sequences=4)


def test_prompts_longer_than_the_step_budget(default_model_dir: Path) -> None:
    """Steps in which no prompt chunk finishes (nothing is sampled) still run: the chunked
    result equals the one-step one (float32, so the chunking cannot flip a near-tie)."""
    prompt = "Count the sheep: " + ", ".join(str(i) for i in range(40))
    outputs = []
    for budget in (8192, 16):
        engine = LLM(
            str(default_model_dir), max_model_len=256, kv_cache_memory=64 << 20,
            dtype="float32", max_num_batched_tokens=budget,
        )  # fmt: skip
        outputs.append(engine.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1]


def test_prompt_logprobs_match_transformers_across_chunks(default_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    engine = LLM(
        str(default_model_dir), max_model_len=256, kv_cache_memory=64 << 20,
        dtype="float32", max_num_batched_tokens=16,  # the prompt spans three steps
    )  # fmt: skip
    ids = engine.get_tokenizer()("The quick brown fox jumps over the lazy dog. " * 4).input_ids
    engine.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)  # now cached: no effect
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    (out,) = engine.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    for i in range(1, len(ids)):
        entry = plp[i]
        assert entry is not None and 4 >= len(entry) >= 3  # the prompt token and the top 3
        want = ref[i - 1]
        assert entry[ids[i]].logprob == pytest.approx(float(want[ids[i]]), abs=1e-3)
        assert entry[ids[i]].rank == int((want >= want[ids[i]]).sum())
        top = want.topk(3).indices.tolist()
        assert all(t in entry for t in top)
