"""Structured output on the default model (XGrammar): every output follows its JSON schema,
pattern, choices or grammar, under greedy and random sampling, next to free requests that it
must not change; bad specifications are clear errors that leave the engine serving."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from baton import LLM, SamplingParams, StructuredOutputsParams
from baton_engine.errors import InvalidRequestError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return LLM(str(default_model_dir), max_model_len=512, kv_cache_memory=128 << 20)


def _params(so: StructuredOutputsParams, **kw: object) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 80)
    return SamplingParams(structured_outputs=so, **kw)  # type: ignore[arg-type]


def _check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age", "city"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert person["city"] in ("Paris", "Rome", "Oslo")


def test_json_schema_greedy_and_sampled(llm: LLM) -> None:
    so = StructuredOutputsParams(json=PERSON)
    params = [_params(so)] + [_params(so, temperature=1.0, seed=s) for s in range(4)]
    outs = llm.chat([PROMPT] * len(params), params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        _check_person(completion.text)
    # a schema given as JSON text is the same schema
    (again,) = llm.chat(PROMPT, _params(StructuredOutputsParams(json=json.dumps(PERSON))))
    assert again.outputs[0].text == outs[0].outputs[0].text


def test_regex_choice_grammar_and_json_object(llm: LLM) -> None:
    prompt = [{"role": "user", "content": "Give me a ticket code."}]
    cases = [
        (StructuredOutputsParams(regex=r"[A-Z]{2}-[0-9]{3}"), r"[A-Z]{2}-[0-9]{3}"),
        (StructuredOutputsParams(choice=["yes", "no", "a (maybe)?"]), r"yes|no|a \(maybe\)\?"),
        (StructuredOutputsParams(grammar='root ::= "red" | "green" | "blue"'), r"red|green|blue"),
    ]
    params = [_params(so, temperature=0.8, seed=7) for so, _ in cases]
    outs = llm.chat([prompt] * 3, params, use_tqdm=False)
    for out, (_, pattern) in zip(outs, cases, strict=True):
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    (obj,) = llm.chat(PROMPT, _params(StructuredOutputsParams(json_object=True), max_tokens=120))
    if obj.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.outputs[0].text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert obj.outputs[0].text.lstrip().startswith("{")


def test_constraint_after_the_reasoning(llm: LLM) -> None:
    """reasoning_end: free text up to its first occurrence, then up to 4 whitespace characters,
    then the constraint. SmolLM2 was not trained to think, so here the "reasoning" ends at the
    first ":" it writes ("Here's a JSON with name, age, and city:"); in serving the end is
    "</think>" (checked token by token below)."""
    cases = [
        (StructuredOutputsParams(json=PERSON, reasoning_end=":"), _check_person),
        (StructuredOutputsParams(choice=["yes", "no"], reasoning_end=":"),
         lambda answer: answer in ("yes", "no")),
    ]  # fmt: skip
    for so, check in cases:
        (out,) = llm.chat(PROMPT, _params(so, max_tokens=120), use_tqdm=False)
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        reasoning, end, answer = completion.text.partition(":")
        assert end and reasoning.strip() and len(answer) - len(answer.lstrip()) <= 4
        assert check(answer.strip()) is not False, completion.text

    tok = llm.get_tokenizer()
    grammar = llm.engine.core.structured.grammar(
        StructuredOutputsParams(choice=["yes", "no"], reasoning_end="</think>")
    )
    text = 'Is {"a": 1} < 2? </thin is not the end, but this is:</think>\n\nyes'
    assert all(grammar.accept(t) for t in tok(text, add_special_tokens=False).input_ids)
    assert grammar.accept(tok.eos_token_id) and grammar.is_ended
    early = llm.engine.core.structured.grammar(
        StructuredOutputsParams(choice=["yes", "no"], reasoning_end="</think>")
    )
    ids = tok("thought</think>maybe", add_special_tokens=False).input_ids
    assert [early.accept(t) for t in ids][-1] is False  # after the tag: the choice only
    with pytest.raises(InvalidRequestError, match="reasoning_end"):
        StructuredOutputsParams(json=PERSON, reasoning_end="")


def test_free_requests_beside_constrained_ones_are_unchanged(default_model_dir: Path) -> None:
    """Async scheduling and multi-step on: the constrained request waits for its tokens and
    runs one pass a step; the free ones in the same batch sample as they do alone."""
    llm = LLM(
        str(default_model_dir),
        max_model_len=512,
        kv_cache_memory=128 << 20,
        async_scheduling=True,
        num_scheduler_steps=4,
    )
    free = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True),
    ]
    prompts = ["The capital of France is", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    mixed = llm.generate(
        [*prompts, "A person:"] * 2,
        [*free, _params(StructuredOutputsParams(json=PERSON))] * 2,
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert [o.outputs[0].token_ids for o in mixed[3:5]] == alone
    _check_person(mixed[2].outputs[0].text)
    assert mixed[5].outputs[0].text == mixed[2].outputs[0].text


ANSWER_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<answer>",
        "content": {"type": "json_schema", "json_schema": PERSON},
        "end": "</answer>",
    },
}
WEATHER_CALLS = {  # vLLM's older form: free text, each trigger starting a tagged call
    "type": "structural_tag",
    "structures": [
        {
            "begin": "<function=get_weather>",
            "schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
            "end": "</function>",
        }
    ],
    "triggers": ["<function="],
}


def test_structural_tags(llm: LLM) -> None:
    """vLLM's structural_tag (XGrammar's): the output follows the tag's format (here one
    tagged JSON value), given as a dict or JSON text; the older structures-and-triggers form
    lets free text through and constrains what follows a trigger."""
    for tag in (ANSWER_TAG, json.dumps(ANSWER_TAG)):
        so = StructuredOutputsParams(structural_tag=tag)
        (out,) = llm.chat(PROMPT, _params(so, max_tokens=100), use_tqdm=False)
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        assert text.startswith("<answer>") and text.endswith("</answer>"), text
        _check_person(text.removeprefix("<answer>").removesuffix("</answer>"))
    grammar = llm.engine.core.structured.grammar(
        StructuredOutputsParams(structural_tag=WEATHER_CALLS)
    )
    tok = llm.get_tokenizer()
    free = 'Let me look. <function=get_weather>{"city": "Oslo"}</function> Done.'
    assert all(grammar.accept(t) for t in tok(free, add_special_tokens=False).input_ids)
    grammar = llm.engine.core.structured.grammar(
        StructuredOutputsParams(structural_tag=WEATHER_CALLS)
    )
    broken = tok('Sure <function=get_weather>{"town"', add_special_tokens=False).input_ids
    assert not all(grammar.accept(t) for t in broken)


def test_bad_specifications_are_clear_errors(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a+")
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputsParams(choice=[])
    bad = [
        (StructuredOutputsParams(json={"type": "nope"}), "json.*nope"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(regex="(ab"), "regex.*parenthesis"),
        (StructuredOutputsParams(grammar="root ::= "), "grammar"),
        (StructuredOutputsParams(structural_tag="{not json"), "structural_tag"),
        (StructuredOutputsParams(structural_tag={"type": "structural_tag"}), "structural_tag"),
        (StructuredOutputsParams(structural_tag={"structures": [{"begin": "<a>"}]}), "structural"),
    ]
    for so, match in bad:
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate(["Hi"], _params(so), use_tqdm=False)
    # and the engine still serves
    (out,) = llm.generate(["Hi"], _params(StructuredOutputsParams(choice=["ok"])))
    assert out.outputs[0].text == "ok"


def test_over_the_wire_and_from_a_first_token(llm: LLM) -> None:
    """The gateway's proto reaches the worker's engine as the same constraint; a decode worker
    continues from the prefill worker's first token, which must follow the grammar."""
    from baton_decode.codec import sampling_params_from_proto
    from baton_gateway import codec
    from baton_gateway.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    for fields, want in [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
            StructuredOutputsParams(json=json.dumps(PERSON)),
        ),
        ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
        ),
    ]:
        request = ChatCompletionRequest.model_validate({"messages": messages, **fields})
        pb = codec.sampling_params(request, max_tokens=8, seed=None)
        assert sampling_params_from_proto(pb).structured_outputs == want

    tok = llm.get_tokenizer()
    core = llm.engine.core
    params = _params(StructuredOutputsParams(choice=["yes", "no"]))
    prompt = tok("Answer:").input_ids
    (maybe,) = tok(" maybe", add_special_tokens=False).input_ids[:1]
    with pytest.raises(InvalidRequestError, match="does not follow"):
        core.add_request("r1", prompt, params, remote_kv=object(), first_token_id=maybe)
    assert "r1" not in core.scheduler.requests and core.scheduler.num_grammars == 0


def test_preempted_requests_keep_their_grammar(default_model_dir: Path) -> None:
    """Recompute preemption leaves a request's grammar where its tokens are: the outputs
    equal those of an engine with room for all of them (float32: sampled tokens then do not
    depend on how requests were batched)."""
    numbers = {
        "type": "array",
        "items": {"type": "integer", "minimum": 100, "maximum": 999},
        "minItems": 8,
        "maxItems": 8,
    }
    so = StructuredOutputsParams(json=numbers, disable_any_whitespace=True)
    params = [_params(so, temperature=1.0, seed=s, max_tokens=80) for s in range(4)]
    prompt = [{"role": "user", "content": "List eight three-digit numbers."}]
    texts = []
    for memory in (64 << 20, 6 << 20):
        engine = LLM(
            str(default_model_dir), max_model_len=128, kv_cache_memory=memory, dtype="float32"
        )
        texts.append([o.outputs[0].text for o in engine.chat([prompt] * 4, params, use_tqdm=False)])
        preemptions = engine.engine.core.scheduler.num_preemptions
    roomy, tight = texts
    assert preemptions > 0
    assert tight == roomy
    for text in tight:
        values = json.loads(text)
        assert len(values) == 8 and all(100 <= v <= 999 for v in values), text
