"""The offline API on the default model: what a vLLM user relies on, and clear errors for bad
input that leave the engine serving."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from baton import LLM, SamplingParams
from baton_engine.errors import InvalidRequestError, ModelLoadError
from baton_engine.sampling_params import tokenize_bad_words

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


def test_chat_takes_vllms_template_arguments(llm: LLM) -> None:
    """``LLM.chat(..., tools=, chat_template_kwargs=, continue_final_message=)`` as vLLM's:
    they reach the template; continuing a partial answer generates what the same prompt's
    token ids do."""
    tok = llm.get_tokenizer()
    template = (
        "{{ greeting }}{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    messages = [{"role": "user", "content": "Hi"}]
    (out,) = llm.chat(
        messages,
        GREEDY,
        use_tqdm=False,
        chat_template=template,
        tools=[tool],
        chat_template_kwargs={"greeting": "Ahoy "},
        add_generation_prompt=False,
    )
    assert tok.decode(out.prompt_token_ids) == "Ahoy [get_weather]<user>Hi"
    partial = [*messages, {"role": "assistant", "content": "The capital of France is"}]
    (cont,) = llm.chat(
        partial, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert tok.decode(cont.prompt_token_ids).endswith("The capital of France is")
    (same,) = llm.generate({"prompt_token_ids": cont.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert cont.outputs[0].token_ids == same.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        llm.chat(partial, GREEDY, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="chat template"):
        llm.chat(messages, GREEDY, chat_template="{% if %}")


def test_prompt_forms_and_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    text = "The capital of France is"
    by_text, by_ids = llm.generate(
        [text, {"prompt_token_ids": tok(text).input_ids}], GREEDY, use_tqdm=False
    )
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == tok.decode(by_text.outputs[0].token_ids)
    # vLLM's TextPrompt dict; text-only: other inputs (images...) are refused
    (by_dict,) = llm.generate({"prompt": text}, GREEDY, use_tqdm=False)
    assert by_dict.prompt == text and by_dict.outputs[0].text == by_text.outputs[0].text
    with pytest.raises(InvalidRequestError, match="multi_modal_data are not supported"):
        llm.generate({"prompt": text, "multi_modal_data": {}}, GREEDY, use_tqdm=False)


def test_cache_salt_in_a_prompt_dict(llm: LLM) -> None:
    """vLLM's ``{"prompt": ..., "cache_salt": ...}``: a prompt hits the prefix cache only
    under its salt; the answer is the same."""
    text = "A salted prompt, long enough to fill two blocks of sixteen tokens: " * 4

    def run(salt: str | None) -> Any:
        prompt: Any = {"prompt": text} if salt is None else {"prompt": text, "cache_salt": salt}
        (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        return out

    first = run("tenant-a")
    again = run("tenant-a")
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 32
    other, unsalted = run("tenant-b"), run(None)
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert again.outputs[0].text == first.outputs[0].text == other.outputs[0].text
    with pytest.raises(InvalidRequestError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt": text, "cache_salt": ""}, GREEDY, use_tqdm=False)


def test_encode_and_reset_prefix_cache(llm: LLM) -> None:
    """vLLM's ``LLM.encode`` (the pooler's output as a tensor: here the embedding) and
    ``LLM.reset_prefix_cache`` (the next prompt computes everything)."""
    texts = ["The capital of France is", "Once upon a time"]
    encoded = llm.encode(texts, use_tqdm=False)
    for got, want in zip(encoded, llm.embed(texts, use_tqdm=False), strict=True):
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.outputs.data.tolist() == pytest.approx(want.outputs.embedding, abs=1e-6)
    with pytest.raises(InvalidRequestError, match="pooling_task 'classify' is not supported"):
        llm.encode(texts, pooling_task="classify", use_tqdm=False)
    prompt = "A prompt to cache, long enough for two blocks of sixteen tokens each. " * 3
    llm.generate(prompt, GREEDY, use_tqdm=False)
    (cached,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert cached.num_cached_tokens >= 32
    assert llm.reset_prefix_cache()
    (fresh,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert fresh.num_cached_tokens == 0 and fresh.outputs[0].text == cached.outputs[0].text


def test_detokenize_false_gives_token_ids_only(llm: LLM) -> None:
    """vLLM's ``detokenize=False``: the same tokens, no text; stop strings need the text."""
    prompt = "The capital of France is"
    (plain,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    raw_params = replace(GREEDY, detokenize=False, spaces_between_special_tokens=False)
    (raw,) = llm.generate(prompt, raw_params, use_tqdm=False)
    assert raw.outputs[0].token_ids == plain.outputs[0].token_ids
    assert raw.outputs[0].text == "" and plain.outputs[0].text
    assert raw.outputs[0].finish_reason == plain.outputs[0].finish_reason
    with pytest.raises(InvalidRequestError, match="detokenize"):
        SamplingParams(stop=["."], detokenize=False)


def test_truncate_prompt_tokens(llm: LLM) -> None:
    """As vLLM: the prompt's last N tokens (-1: max_model_len's worth) are the prompt."""
    tok = llm.get_tokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 3 + "The capital of France is"
    ids = tok(text).input_ids
    greedy = SamplingParams(temperature=0, max_tokens=8)
    cut, tail, whole, plain = llm.generate(
        [text, {"prompt_token_ids": ids[-6:]}, text, text],
        [
            SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=6),
            greedy,
            SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=-1),
            greedy,
        ],
        use_tqdm=False,
    )
    assert cut.prompt_token_ids == ids[-6:] and len(ids) > 6
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    assert whole.prompt_token_ids == ids
    assert whole.outputs[0].token_ids == plain.outputs[0].token_ids
    long = "word " * 300  # beyond max_model_len (256): refused unless truncated first
    kept = llm.generate(
        [long], SamplingParams(max_tokens=2, truncate_prompt_tokens=200), use_tqdm=False
    )
    assert len(kept[0].prompt_token_ids) == 200 and len(kept[0].outputs[0].token_ids) == 2
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([text], SamplingParams(truncate_prompt_tokens=10**6), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


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
    # as vLLM: the stop token's text shows only with include_stop_str_in_output
    assert out.outputs[0].text == "" and free.outputs[0].text
    shown = replace(params, include_stop_str_in_output=True)
    (out,) = llm.generate(["The capital of France is"], shown, use_tqdm=False)
    assert out.outputs[0].text == llm.get_tokenizer().decode([first])
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


def test_bad_words_are_tokenized_as_vllm_does(llm: LLM) -> None:
    """Each word is banned as the tokenizer spells it at the start of a text and also after a
    space, when that starts with another token and is as long (vLLM's rule: " banana" is one
    token, "banana" two, so only the latter is banned); leading whitespace is dropped."""
    tok = llm.get_tokenizer()

    def ids(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    assert len(ids("Paris")) == len(ids(" Paris")) == 1 and ids("Paris") != ids(" Paris")
    assert len(ids("hello world")) == len(ids(" hello world")) == 2
    assert len(ids("banana")) != len(ids(" banana"))
    assert tokenize_bad_words(["Paris", "  hello world", "banana"], tok) == [
        ids("Paris"),
        ids(" Paris"),
        ids("hello world"),
        ids(" hello world"),
        ids("banana"),
    ]
    words = SamplingParams(bad_words=["Paris"])
    tokenized = llm.engine.tokenize_bad_words(words)
    assert tokenized.bad_words_token_ids == [ids("Paris"), ids(" Paris")]
    assert words.bad_words_token_ids is None  # the caller's params are left as they were


def test_bad_words_are_never_generated(llm: LLM) -> None:
    """Greedy decoding with a word of its own output banned: a one-token word never comes, and
    a two-token word's second token never comes right after its first, so the output leaves
    the unconstrained one exactly there; a sequence whose first token ends the prompt bans
    nothing; a request without bad words in the same batch is untouched."""
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (plain,) = llm.generate([prompt], base, use_tqdm=False)
    plain_ids = plain.outputs[0].token_ids
    first = tok.decode(plain_ids[:1]).strip()  # "Paris"

    def words(i: int) -> str:  # output tokens i and i + 1 as text
        return str(tok.decode(plain_ids[i : i + 2])).strip()

    # the first two tokens of the output that spell words and are how those words tokenize
    at = next(
        i
        for i in range(1, len(plain_ids) - 1)
        if words(i).replace(" ", "").isalpha()
        and plain_ids[i : i + 2] in tokenize_bad_words([words(i)], tok)
    )
    pair = words(at)  # "answer is"
    one, two = replace(base, bad_words=[first]), replace(base, bad_words=[pair])
    # its first token after the prompt's last: the prompt does not count
    after_prompt = replace(base, bad_words_token_ids=[[plain.prompt_token_ids[-1], plain_ids[0]]])
    outs = llm.generate([prompt] * 4, [one, two, base, after_prompt], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for params, tokens in zip((one, two), got[:2], strict=True):
        assert len(tokens) == 16
        for seq in llm.engine.tokenize_bad_words(params).bad_words_token_ids or []:
            assert all(tokens[i : i + len(seq)] != seq for i in range(len(tokens))), seq
    assert got[0][0] != plain_ids[0]
    assert got[1][: at + 1] == plain_ids[: at + 1] and got[1][at + 1] != plain_ids[at + 1]
    assert got[2] == got[3] == plain_ids


def test_bad_words_errors(llm: LLM) -> None:
    """Words that encode to nothing, empty or negative sequences, ids outside the vocabulary,
    and words that reach the engine core untokenized are clear errors."""
    prompt = "The capital of France is"
    for kwargs, match in (
        ({"bad_words": "Paris"}, "list of strings"),
        ({"bad_words_token_ids": [[5], []]}, "empty sequence"),
        ({"bad_words_token_ids": [[-1]]}, "non-negative"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams(**kwargs)
    for params, match in (
        (SamplingParams(bad_words=["Paris", "  "]), "encodes to no token"),
        (SamplingParams(bad_words_token_ids=[[1, 10**7]]), "bad_words token id"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate([prompt], params, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="must come tokenized"):
        llm.engine.core.add_request("untokenized", [1, 2, 3], SamplingParams(bad_words=["a"]))
    assert not llm.engine.has_unfinished_requests()


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


def test_vllms_arguments_and_a_separate_tokenizer(default_model_dir: Path, tmp_path: Path) -> None:
    """``LLM(model, tokenizer=..., trust_remote_code=True, swap_space=4, quantization=None,
    max_logprobs=2)`` as vLLM scripts write it: the tokenizer comes from its own folder (no
    config.json needed), requests may ask for at most ``max_logprobs`` logprobs, the other
    arguments change nothing; a missing tokenizer fails the start."""
    import shutil

    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    for f in default_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, tok_dir / f.name)
    small = dict(max_model_len=128, kv_cache_memory=16 << 20)
    llm = LLM(
        str(default_model_dir),
        tokenizer=str(tok_dir),
        trust_remote_code=True,
        swap_space=4,
        quantization=None,
        max_logprobs=2,
        **small,
    )
    assert llm.get_tokenizer().name_or_path == str(tok_dir)
    two = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, prompt_logprobs=2)
    (allowed,) = llm.generate("The capital of France is", two, use_tqdm=False)
    assert allowed.outputs[0].logprobs is not None and len(allowed.outputs[0].logprobs[0]) >= 2
    for kind, too_many in (("sample", {"logprobs": 3}), ("prompt", {"prompt_logprobs": 3})):
        params = SamplingParams(max_tokens=1, **too_many)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match=f"{kind} logprobs of 3, .* max allowed: 2"):
            llm.generate("The capital of France is", params, use_tqdm=False)
    (out,) = llm.generate("The capital of France is", GREEDY, use_tqdm=False)
    reference = LLM(str(default_model_dir), **small)
    (want,) = reference.generate("The capital of France is", GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == want.prompt_token_ids
    assert out.outputs[0].text == want.outputs[0].text
    with pytest.raises(ModelLoadError, match="tokenizer path"):
        LLM(str(default_model_dir), tokenizer=str(tmp_path / "missing"), **small)
    with pytest.raises(InvalidRequestError, match="quantization 'gptq'"):
        LLM(str(default_model_dir), quantization="gptq", **small)
    with pytest.raises(InvalidRequestError, match="at most 20 logprobs per token"):
        LLM(str(default_model_dir), max_logprobs=50, **small)


PRIORITY_PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "Once upon a time, a dragon",
    "def fibonacci(n):",
]


def test_priority_scheduling_serves_the_best_ranked_first(default_model_dir: Path) -> None:
    """vLLM's priority policy, one request at a time: the waiting request with the lowest
    priority value (then the earliest) runs next. Outputs are each prompt's alone."""
    llm = LLM(
        str(default_model_dir), max_model_len=256, kv_cache_memory=32 << 20, dtype="float32",
        scheduling_policy="priority", max_num_seqs=1,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6)
    engine = llm.engine  # the order they are served in shows through the engine's own API
    for req_id, prompt, priority in zip("abc", PRIORITY_PROMPTS[:3], [1, 0, 1], strict=True):
        engine.add_request(req_id, prompt, params, priority=priority)
    finished = engine.step()  # b runs
    engine.add_request("d", PRIORITY_PROMPTS[3], params, priority=0)  # ahead of a and c
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [out.request_id for out in finished] == ["b", "d", "a", "c"]  # fcfs: a, b, c, d
    alone = {out.prompt: out.outputs[0].token_ids for out in finished}  # (one at a time)
    outs = llm.generate(PRIORITY_PROMPTS, params, use_tqdm=False, priority=[3, 0, 2, 1])
    assert [o.prompt for o in outs] == PRIORITY_PROMPTS  # in the prompts' order, as vLLM's
    assert [o.outputs[0].token_ids for o in outs] == [alone[p] for p in PRIORITY_PROMPTS]


def test_priority_preemption_keeps_the_outputs(default_model_dir: Path) -> None:
    """A pool of 4 blocks (of 16 tokens) for 4 requests of 2: the lowest-priority ones are
    preempted and recomputed, and every output is still the prompt's alone."""
    llm = LLM(
        str(default_model_dir), max_model_len=64, num_gpu_blocks_override=4, dtype="float32",
        scheduling_policy="priority",
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = PRIORITY_PROMPTS
    alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert llm.engine.core.stats().num_preemptions == 0
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[3, 0, 2, 1])
    assert llm.engine.core.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_priority_needs_the_priority_policy(llm: LLM) -> None:
    """Under fcfs (the default) a priority other than 0 is an error, as in vLLM; so is a
    priority list whose length is not the prompts'."""
    with pytest.raises(InvalidRequestError, match="priority scheduling is not enabled"):
        llm.generate(["Hi", "Hello"], GREEDY, use_tqdm=False, priority=[0, 1])
    with pytest.raises(InvalidRequestError, match="priority scheduling is not enabled"):
        llm.engine.add_request("x", "Hi", GREEDY, priority=-1)
    with pytest.raises(InvalidRequestError, match="2 prompts but 1 priorities"):
        llm.generate(["Hi", "Hello"], GREEDY, use_tqdm=False, priority=[0])
    assert not llm.engine.has_unfinished_requests()  # nothing left half-submitted
    assert llm.generate(["Hi"], GREEDY, use_tqdm=False, priority=[0])[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="scheduling_policy"):
        LLM(scheduling_policy="lifo")


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
