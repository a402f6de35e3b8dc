"""The OpenAI API of ``baton serve``, driven by the official ``openai`` SDK (sync and async).

All tests share one ``baton serve`` (see conftest.py). Greedy requests (temperature 0) are
deterministic, so streamed and non-streamed results must match exactly.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types.chat import ChatCompletionMessageParam

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
JSON_CONTENT = {"content-type": "application/json"}
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France? Answer in a sentence."}
]
STORY: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a short story about a dragon who learns to fly."}
]


def _wait_for(
    predicate: Callable[[], bool],
    timeout_s: float = 15.0,
    observe: Callable[[], object] | None = None,
) -> None:
    """Poll ``predicate`` until it holds; on timeout fail with what ``observe`` sees then."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            seen = f": {observe()!r}" if observe is not None else ""
            raise AssertionError(f"condition not met in {timeout_s} s{seen}")
        time.sleep(0.1)


def _metric(http: httpx.Client, name: str, **labels: str) -> list[float]:
    """Values of every sample of ``name`` whose labels include ``labels``."""
    values = []
    for line in http.get("/metrics").text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rindex("}")]))
        if all(found.get(k) == v for k, v in labels.items()):
            values.append(float(line.rsplit(" ", 1)[1]))
    return values


def _chat_stream(client: OpenAI, **kwargs: Any) -> tuple[dict[int, str], dict[int, str], Any]:
    """Streamed chat: text and finish reason per choice index, and the usage chunk (or None)."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    first = True
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if first:
                assert choice.delta.role == "assistant"
            first = False
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "two finish reasons for one choice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


# ---------------------------------------------------------------------------------------------
# Models, chat and completions


def test_models(client: OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra is not None and models[0].model_extra["max_model_len"] == 512
    # OpenAI's retrieve: the same card; another name is a 404 (names may hold slashes)
    assert client.models.retrieve(MODEL).model_dump() == models[0].model_dump()
    for missing in ("nope", "org/nope"):
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.models.retrieve(missing)


def test_chat_streaming_equals_non_streaming(client: OpenAI) -> None:
    full = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=40
    )
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    assert full.usage is not None
    usage = full.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    texts, reasons, stream_usage = _chat_stream(
        client,
        messages=QUESTION,
        temperature=0,
        max_tokens=40,
        stream_options={"include_usage": True},
    )
    assert texts == {0: choice.message.content} and reasons == {0: choice.finish_reason}
    assert stream_usage is not None
    assert (stream_usage.prompt_tokens, stream_usage.completion_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )


def test_chat_echo_continues_the_final_message(client: OpenAI) -> None:
    """vLLM's chat ``echo``: an answer continuing a partial assistant message
    (``continue_final_message``) starts with that message's text, streamed or not, for every
    choice; without a generation prompt the answer takes the last message's role; echo is
    ignored when the last message has another role."""
    start = "The capital of France is"
    partial: list[ChatCompletionMessageParam] = [
        *QUESTION,
        {"role": "assistant", "content": start},
    ]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": partial,
        "temperature": 0,
        "max_tokens": 12,
        "extra_body": {"add_generation_prompt": False, "continue_final_message": True},
    }
    plain_response = client.chat.completions.create(**kwargs)
    plain = plain_response.choices[0].message
    assert plain.role == "assistant" and plain.content and not plain.content.startswith(start)
    kwargs["extra_body"] = {**kwargs["extra_body"], "echo": True}
    echoed = client.chat.completions.create(n=2, **kwargs)
    for choice in echoed.choices:
        assert choice.message.content == start + plain.content
    rest = {k: v for k, v in kwargs.items() if k != "model"}
    texts, reasons, _ = _chat_stream(client, n=2, **rest)
    assert texts == {0: start + plain.content, 1: start + plain.content}
    assert set(reasons) == {0, 1}
    # The usage counts generated tokens only, as without echo.
    assert echoed.usage is not None and plain_response.usage is not None
    assert echoed.usage.completion_tokens == 2 * plain_response.usage.completion_tokens
    # A user's message is not echoed into the assistant's answer.
    asked = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=12, extra_body={"echo": True}
    )
    plain_asked = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=12
    )
    assert asked.choices[0].message.content == plain_asked.choices[0].message.content
    # No generation prompt: the answer goes on in the last message's role (and echoes it).
    as_user = (
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=4,
            extra_body={"add_generation_prompt": False, "echo": True},
        )
        .choices[0]
        .message
    )
    assert as_user.role == "user"
    assert (as_user.content or "").startswith(str(QUESTION[0]["content"]))


def test_completion_streaming_equals_non_streaming(client: OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "The sky is", "temperature": 0}
    full = client.completions.create(max_tokens=24, **kwargs)
    assert full.object == "text_completion" and full.usage is not None
    assert full.usage.completion_tokens <= 24
    text, reason, usage = "", None, None
    stream = client.completions.create(
        max_tokens=24, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    assert text == full.choices[0].text and reason == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_n_choices(client: OpenAI) -> None:
    full = client.chat.completions.create(
        model=MODEL, messages=STORY, n=2, seed=7, temperature=1.0, max_tokens=12
    )
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert all(c.message.content for c in full.choices)
    assert full.usage is not None and full.usage.completion_tokens <= 24
    texts, reasons, _ = _chat_stream(
        client, messages=STORY, n=2, seed=7, temperature=1.0, max_tokens=12
    )
    assert sorted(texts) == [0, 1] and sorted(reasons) == [0, 1]
    # The same seeds give the same choices, streamed or not.
    assert texts == {c.index: c.message.content for c in full.choices}


def test_stop_strings_never_leak(client: OpenAI) -> None:
    base = client.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=60)
    text = base.choices[0].message.content or ""
    assert len(text) > 40, text
    # A stop string from the middle of the greedy output, likely spanning token boundaries.
    stop = text[20:26]
    expected = text[: text.index(stop)]
    full = client.chat.completions.create(
        model=MODEL, messages=STORY, temperature=0, max_tokens=60, stop=[stop, "\x00never"]
    )
    choice = full.choices[0]
    assert choice.message.content == expected
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra["stop_reason"] == stop
    assert full.usage is not None and full.usage.completion_tokens < 60
    pieces = []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=STORY, temperature=0, max_tokens=60, stop=stop, stream=True
    ):
        pieces += [c.delta.content or "" for c in chunk.choices]
    assert "".join(pieces) == expected
    assert stop not in "".join(pieces)
    # include_stop_str_in_output keeps it (vLLM's extra).
    kept = client.chat.completions.create(
        model=MODEL,
        messages=STORY,
        temperature=0,
        max_tokens=60,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].message.content == expected + stop


def test_stop_tokens_text_shows_only_when_asked(http: httpx.Client) -> None:
    """As vLLM: a completion stopped at one of its stop_token_ids (or EOS) does not show that
    token's text, streamed or not, unless include_stop_str_in_output; token_ids keep it."""
    body: dict[str, Any] = {"prompt": "The sky is", "max_tokens": 12, "temperature": 0}
    free = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    ids = free["choices"][0]["token_ids"]
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # a word seen first there
    stop_at = ids[k]
    before = http.post("/detokenize", json={"tokens": ids[:k]}).json()["prompt"]
    upto = http.post("/detokenize", json={"tokens": ids[: k + 1]}).json()["prompt"]
    body |= {"stop_token_ids": [stop_at], "return_token_ids": True}
    stopped = http.post("/v1/completions", json=body).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop_at
    assert stopped["token_ids"] == ids[: k + 1] and stopped["text"] == before
    streamed = http.post("/v1/completions", json={**body, "stream": True}).text
    texts = [json.loads(line[6:]) for line in streamed.splitlines() if line[6:].startswith("{")]
    assert "".join(c["text"] for t in texts for c in t["choices"]) == before
    shown = {**body, "include_stop_str_in_output": True}
    assert http.post("/v1/completions", json=shown).json()["choices"][0]["text"] == upto


def test_beam_search(http: httpx.Client) -> None:
    """vLLM's ``use_beam_search``: ``n`` beams per prompt, the ``n`` best as the choices;
    one beam is greedy decoding; what beam search cannot do here is a clear 400."""
    body: dict[str, Any] = {"prompt": "The capital of France is", "max_tokens": 4}
    greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()
    one = http.post("/v1/completions", json={**body, "use_beam_search": True}).json()
    assert one["choices"][0]["text"] == greedy["choices"][0]["text"]
    three = http.post(
        "/v1/completions",
        json={**body, "use_beam_search": True, "n": 3, "return_token_ids": True},
    ).json()
    choices = three["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 3
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    assert three["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": QUESTION, "max_tokens": 4, "n": 2, "use_beam_search": True},
    ).json()
    assert len(chat["choices"]) == 2 and all(c["message"]["content"] for c in chat["choices"])
    for extra, message in (
        ({"stream": True}, "does not support stream"),
        ({"n": 11}, "at most 10"),
        ({"stop": ["."]}, "does not support stop"),
        ({"logprobs": 2}, "does not support logprobs"),
        ({"prompt_logprobs": 1}, "does not support prompt_logprobs"),
    ):
        reply = http.post("/v1/completions", json={**body, "use_beam_search": True, **extra})
        assert reply.status_code == 400 and message in reply.text, reply.text


def test_seed_is_reproducible(client: OpenAI) -> None:
    def run() -> str:
        out = client.chat.completions.create(
            model=MODEL, messages=STORY, temperature=1.0, seed=1234, max_tokens=16
        )
        return out.choices[0].message.content or ""

    assert run() == run()


def test_chat_logprobs(client: OpenAI) -> None:
    full = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    assert full.usage is not None
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == full.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.token == entry.top_logprobs[0].token  # greedy: the most likely token
        assert entry.bytes == list(entry.token.encode())
    streamed: list[Any] = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed += c.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]


def test_completion_logprobs(client: OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="One, two, three,", temperature=0, max_tokens=6, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert out.usage is not None and len(lp.tokens) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset is not None and lp.text_offset == sorted(lp.text_offset)
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert top is not None and token in top and len(top) >= 2


def test_echo_with_logprobs_returns_prompt_logprobs(client: OpenAI) -> None:
    prompt = "One, two, three, four,"
    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=4, logprobs=2, echo=True
    )
    out = client.completions.create(**kwargs)
    lp = out.choices[0].logprobs
    assert out.usage is not None
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    n_prompt, n_out = out.usage.prompt_tokens, out.usage.completion_tokens
    assert len(lp.tokens) == n_prompt + n_out  # every echoed prompt token, then the new ones
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # as vLLM
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == prompt
    assert out.choices[0].text.startswith(prompt)
    # Streamed: the echo arrives with its logprobs, then the same tokens.
    tokens: list[str] = []
    values: list[float | None] = []
    text = ""
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                values += choice.logprobs.token_logprobs or []
    assert text == out.choices[0].text
    assert tokens == lp.tokens
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)


def test_max_tokens_and_vllm_extras(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=7,
        extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert out.usage is not None and out.usage.completion_tokens == 7
    assert out.choices[0].finish_reason == "length"
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_completion_tokens=3
    )
    assert out.usage is not None and out.usage.completion_tokens == 3
    # min_tokens keeps EOS away: the short answer to QUESTION would stop well before 30.
    out = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=30,
        extra_body={"min_tokens": 30},
    )
    assert out.usage is not None and out.usage.completion_tokens == 30


def test_completion_prompt_forms_and_echo(client: OpenAI, baton_server: Any) -> None:
    text_out = client.completions.create(
        model=MODEL, prompt="Hello, my name is", temperature=0, max_tokens=8
    )
    assert text_out.usage is not None
    num_prompt = text_out.usage.prompt_tokens
    from baton_engine.model_files import load_model_tokenizer

    ids = load_model_tokenizer(None).encode("Hello, my name is")
    assert len(ids) == num_prompt
    ids_out = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    assert ids_out.choices[0].text == text_out.choices[0].text
    many = client.completions.create(
        model=MODEL, prompt=["Hello, my name is", "The sky is"], temperature=0, max_tokens=8
    )
    assert sorted(c.index for c in many.choices) == [0, 1]
    assert many.choices[0].text == text_out.choices[0].text
    assert many.usage is not None and many.usage.prompt_tokens > num_prompt
    lists = client.completions.create(model=MODEL, prompt=[ids, ids], temperature=0, max_tokens=8)
    assert [c.text for c in lists.choices] == [text_out.choices[0].text] * 2
    echo = client.completions.create(
        model=MODEL, prompt="Hello, my name is", temperature=0, max_tokens=8, echo=True
    )
    assert echo.choices[0].text == "Hello, my name is" + text_out.choices[0].text


def test_async_client_and_32_concurrent_streams(baton_server: Any) -> None:
    async def main() -> None:
        async with AsyncOpenAI(
            base_url=baton_server.base_url, api_key=baton_server.api_key, max_retries=0
        ) as aclient:
            full = await aclient.chat.completions.create(
                model=MODEL, messages=QUESTION, temperature=0, max_tokens=16
            )
            assert full.choices[0].message.content

            async def one(i: int) -> tuple[str, str | None, int]:
                stream = await aclient.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
                    max_tokens=16,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                text, reason, tokens = "", None, -1
                async for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    for c in chunk.choices:
                        text += c.delta.content or ""
                        reason = c.finish_reason or reason
                return text, reason, tokens

            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 180)
            for text, reason, tokens in results:
                assert text and reason == "length" and tokens == 16

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# Tool calling (the shared server runs with --enable-auto-tool-choice --tool-call-parser hermes)

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
WEATHER_QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather like in Paris today?"}
]


def _tool_chat(client: OpenAI, **kwargs: Any) -> tuple[Any, Any]:
    """The same greedy request whole and streamed: each as (content, [(name, arguments)],
    finish_reason), the stream's pieces merged as a client merges them."""
    args = dict(model=MODEL, messages=WEATHER_QUESTION, max_tokens=60, temperature=0.0)
    args.update(kwargs)
    whole = client.chat.completions.create(**args).choices[0]  # type: ignore[call-overload]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert all(c.id.startswith("chatcmpl-tool-") for c in whole.message.tool_calls or [])
    content, pieces, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **args):  # type: ignore[call-overload]
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                if piece.index not in pieces:  # a call's first piece: its id and name
                    assert piece.id and piece.type == "function" and piece.function.name
                    pieces[piece.index] = [piece.function.name, ""]
                else:
                    assert piece.id is None and piece.function.name is None
                pieces[piece.index][1] += piece.function.arguments or ""
            reason = choice.finish_reason or reason
    streamed = [tuple(pieces[i]) for i in sorted(pieces)]
    return (whole.message.content, calls, whole.finish_reason), (content or None, streamed, reason)


def _weather_arguments(arguments: str) -> dict[str, Any]:
    """A get_weather call's arguments, checked against its schema."""
    parsed = json.loads(arguments)
    assert set(parsed) == {"city", "unit"} and isinstance(parsed["city"], str), parsed
    assert parsed["unit"] in ("celsius", "fahrenheit")
    return dict(parsed)


def test_named_tool_choice(client: OpenAI) -> None:
    """A named tool_choice: one call to that function, arguments valid for its schema (the
    worker constrains them), finish_reason "stop" (OpenAI's); streamed the same."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, streamed = _tool_chat(client, tools=[TIME_TOOL, WEATHER_TOOL], tool_choice=named)
    assert whole == streamed
    content, [(name, arguments)], reason = whole
    assert content is None and name == "get_weather" and reason == "stop"
    _weather_arguments(arguments)


def test_required_tool_choice(client: OpenAI) -> None:
    """tool_choice "required": one or more calls, each to one of the tools with valid
    arguments, finish_reason "tool_calls"; parallel_tool_calls=false: exactly one."""
    for parallel in (True, False):
        whole, streamed = _tool_chat(
            client,
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        assert whole == streamed
        content, calls, reason = whole
        assert content is None and reason == "tool_calls" and calls
        assert len(calls) == 1 or parallel
        for name, arguments in calls:
            assert name in ("get_weather", "get_time")
            if name == "get_weather":
                _weather_arguments(arguments)
            else:
                assert set(json.loads(arguments)) == {"zone"}


def test_auto_tool_choice_with_the_hermes_parser(client: OpenAI) -> None:
    """tool_choice "auto" (the default with tools): the hermes parser finds a call in the
    model's text. SmolLM2 was not trained to call tools, so a regex steers it into Hermes'
    format here; the city is the model's. Without the regex it answers in prose, which comes
    back as the content, the same as without tools or with tool_choice "none" (its chat
    template ignores tools)."""
    hermes = (
        r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Z][a-z]{2,9}", "unit": "celsius"\}\}\n</tool_call>'
    )
    whole, streamed = _tool_chat(
        client,
        tools=[WEATHER_TOOL],
        max_tokens=100,
        extra_body={"structured_outputs": {"regex": hermes}},
    )
    assert whole == streamed
    content, [(name, arguments)], reason = whole
    assert content == "I will check." and name == "get_weather" and reason == "tool_calls"
    _weather_arguments(arguments)
    prose = [_tool_chat(client, tools=[WEATHER_TOOL]), _tool_chat(client)]
    prose.append(_tool_chat(client, tools=[WEATHER_TOOL], tool_choice="none"))
    for whole, streamed in prose:
        assert whole == streamed == prose[0][0]
    content, calls, reason = prose[0][0]
    assert content and "<tool_call>" not in content and calls == [] and reason == "length"


# SmolLM2's template, ending the prompt inside a thinking block as Qwen3's thinking templates do.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n"
)


def _reasoning_chat(http: httpx.Client, **fields: Any) -> tuple[Any, Any]:
    """The same greedy chat request whole and streamed, each as its raw JSON
    (reasoning, reasoning_content, content); the stream's deltas concatenated (None if empty)."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0, **fields}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    whole = (message["reasoning"], message["reasoning_content"], message["content"])
    parts = {"reasoning": "", "reasoning_content": "", "content": ""}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for key in parts:
                        parts[key] += choice["delta"].get(key) or ""
    return whole, tuple(parts[k] or None for k in ("reasoning", "reasoning_content", "content"))


def test_reasoning_outputs_with_the_qwen3_parser(http: httpx.Client) -> None:
    """The shared server runs --reasoning-parser qwen3. A prompt that leaves <think> open makes
    the output reasoning (SmolLM2 never closes the block), in `reasoning` and its older name
    `reasoning_content`, streamed the same; include_reasoning=false drops it; a prompt with no
    open block is all content, with or without a structured output; with an open block, a
    structured output waits for the reasoning to end."""
    whole, streamed = _reasoning_chat(http, chat_template=THINKING_TEMPLATE)
    assert whole == streamed
    reasoning, reasoning_content, content = whole
    assert reasoning and reasoning_content == reasoning and content is None
    hidden = _reasoning_chat(http, chat_template=THINKING_TEMPLATE, include_reasoning=False)
    assert hidden[0] == hidden[1] == (None, None, None)
    plain = _reasoning_chat(http)
    assert plain[0] == plain[1] and plain[0][:2] == (None, None) and plain[0][2]
    # Structured output after a prompt with no open block: JSON from the first token, content.
    structured = _reasoning_chat(http, response_format={"type": "json_object"})
    assert structured[0] == structured[1] and structured[0][:2] == (None, None)
    json.loads(structured[0][2])
    # After an open block the model reasons first: the same prose as without the constraint,
    # not JSON. The grammar waits for </think>, which SmolLM2 never writes, and does not let it
    # stop before: all of it is reasoning, longer than its free answer.
    thinking = _reasoning_chat(
        http, chat_template=THINKING_TEMPLATE, response_format={"type": "json_object"}
    )
    assert thinking[0] == thinking[1] and thinking[0][2] is None
    assert thinking[0][0].startswith(reasoning) and len(thinking[0][0]) > len(reasoning)


def test_tool_request_errors(client: OpenAI) -> None:
    """vLLM's checks: tool_choice without tools, a named tool that is not among them, empty
    tools, a required choice with another structured output."""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": "required"}, "`tools` must be set"),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "Tool 'nope' has not been passed",
        ),
        ({"tools": []}, "must not be an empty array"),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "not both",
        ),
    ]
    for fields, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, **fields)


# ---------------------------------------------------------------------------------------------
# Errors, auth, disconnects, metrics


def _assert_error(exc: openai.APIStatusError, status: int) -> None:
    assert exc.status_code == status
    body = exc.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["message"]


def test_error_statuses(client: OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    _assert_error(nf.value, 404)
    for bad in (
        {"temperature": -1},
        {"top_p": 0},
        {"n": 0},
        {"max_tokens": 0},
        {"logprobs": True, "top_logprobs": 21},
        {"top_logprobs": 2},  # without logprobs
        {"stream_options": {"include_usage": True}},  # without stream
    ):
        with pytest.raises(openai.BadRequestError) as br:
            client.chat.completions.create(model=MODEL, messages=QUESTION, **bad)
        _assert_error(br.value, 400)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=600)
    _assert_error(too_long.value, 400)
    assert "maximum context length is 512" in too_long.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="word " * 600, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**7], max_tokens=1)
    malformed = http.post(
        "/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == 400
    not_object = http.post("/v1/completions", json=[1, 2, 3])
    assert not_object.status_code == 400
    # A lone UTF-16 surrogate is valid JSON but no Unicode: tokenizers, protobuf and the JSON
    # encoder refuse it deep inside, so every route refuses it first (a pair is one character).
    for path, body in (
        ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud83d", "max_tokens": 1}'),
        ("/v1/chat/completions", b'{"model": "\\udc00", "messages": [{"role": "user"}]}'),
        ("/v1/score", b'{"model": "%s", "text_1": "a", "text_2": ["\\ud83d"]}'),
        ("/tokenize", b'{"prompt": "\\ud83d", "\\ude00": 1}'),
    ):
        lone = http.post(path, content=body.replace(b"%s", MODEL.encode()), headers=JSON_CONTENT)
        assert lone.status_code == 400, (path, lone.text)
        assert "lone UTF-16 surrogate" in lone.json()["error"]["message"]
    pair = http.post("/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}', headers=JSON_CONTENT)
    assert pair.status_code == 200 and pair.json()["tokens"]
    assert http.post("/detokenize", json={"tokens": pair.json()["tokens"]}).json() == {
        "prompt": "\U0001f600"
    }
    # Still serving.
    ok = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert ok.choices[0].message.content


def test_constraints_that_allow_no_token_do_not_fail_the_engine(
    client: OpenAI, http: httpx.Client
) -> None:
    """allowed_token_ids that a grammar forbids leave no token to sample. Such a step used to
    fail (a token id out of the vocabulary), taking every request in it along, and the third
    in a row stopped the engine: now the request ends (its grammar refuses the token drawn)
    and everything else keeps being served."""
    for _ in range(4):
        reply = http.post(
            "/v1/completions",
            json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 1.0,
                "allowed_token_ids": [1, 2, 3], "guided_regex": "[a-z]+",
            },
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "stop"
    ok = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert ok.choices[0].message.content


def test_invocations_picks_the_endpoint_by_the_body(http: httpx.Client, baton_server: Any) -> None:
    """SageMaker's one route, as vLLM serves it: a chat completion's body is answered as one,
    a completion's as one, and so on; a body that is none of them is a 400. The API key guards
    it as it guards /v1."""
    bodies_and_kinds = (
        ({"messages": QUESTION, "max_tokens": 2}, "chat.completion"),
        ({"prompt": "Hi", "max_tokens": 2}, "text_completion"),
        ({"input": "Hi"}, "embedding"),
        ({"text_1": "Hi", "text_2": ["Hello", "Bye"]}, "score"),
    )
    for body, kind in bodies_and_kinds:
        reply = http.post("/invocations", json={"model": MODEL, **body})
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert kind in (answer["object"], answer.get("data", [{}])[0].get("object")), answer
    rerank = http.post("/invocations", json={"query": "Hi", "documents": ["Hello", "Bye"]})
    assert rerank.status_code == 200 and len(rerank.json()["results"]) == 2, rerank.text
    neither = http.post("/invocations", json={"model": MODEL, "question": "Hi"})
    assert neither.status_code == 400
    assert "cannot find an endpoint" in neither.json()["error"]["message"]
    keyless = httpx.post(f"{baton_server.root_url}/invocations", json={"prompt": "Hi"})
    assert keyless.status_code == 401


def test_load_counts_the_requests_in_flight(client: OpenAI, http: httpx.Client) -> None:
    """vLLM's GET /load: the requests the server is serving (a stream while it is open)."""

    def load() -> int:
        reply = http.get("/load")
        assert reply.status_code == 200
        server_load: int = reply.json()["server_load"]
        return server_load

    stream = client.completions.create(
        model=MODEL, prompt="Count to a hundred:", max_tokens=400, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    with stream:
        next(iter(stream))
        assert load() >= 1
    deadline = time.monotonic() + 30
    while load() != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _cached_tokens(http: httpx.Client, prompt: str, salt: str | None = None) -> int:
    """How many of ``prompt``'s tokens a completion found in the prefix cache."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    details = reply.json()["usage"]["prompt_tokens_details"]
    return 0 if details is None else int(details["cached_tokens"])


def test_reset_prefix_cache_on_every_worker(http: httpx.Client) -> None:
    """vLLM's POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE): the decode and prefill workers
    forget their cached blocks, so a prompt cached there (local prefill, then remote) is
    computed anew; while a request holds blocks it is a 409 that says so, and nothing
    changes."""

    def reset() -> httpx.Response:
        """The reset, once no KV lease is left (the prefill worker's end when the decode
        worker has pulled; released just after the answer)."""
        deadline = time.monotonic() + 5
        while (reply := http.post("/reset_prefix_cache")).status_code == 409:
            assert time.monotonic() < deadline, reply.text
            time.sleep(0.1)
        return reply

    for words in (40, 300):  # local prefill, then remote
        prompt = f"A prompt to forget, {words} words:" + " hello" * words
        _cached_tokens(http, prompt)
        assert _cached_tokens(http, prompt) >= words - 16
        assert reset().status_code == 200
        assert _cached_tokens(http, prompt) == 0, words

    prompt = "Kept while a request runs:" + " hello" * 40
    _cached_tokens(http, prompt)
    body = {"model": MODEL, "messages": STORY, "max_tokens": 400, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        # The role chunk, then two tokens: the decode worker runs it (a prefill worker may
        # have sampled the first).
        chunks = (line for line in resp.iter_lines() if '"content":"' in line)
        for _ in range(3):
            next(chunks)
        busy = http.post("/reset_prefix_cache")
        assert busy.status_code == 409, busy.text
        assert "requests or KV leases hold blocks" in busy.json()["error"]["message"]
    assert _cached_tokens(http, prompt) >= 40 - 16  # (not reset)
    assert reset().status_code == 200  # (the stream's request aborted)


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(http: httpx.Client) -> None:
    """vLLM's cache_salt: a prompt hits the prefix cache only under the salt it was cached
    with (so one tenant cannot learn from a hit what another sent), with local prefill and
    with remote prefill (a prompt past the remote-prefill threshold: the prefill worker's
    blocks, the KV handle's hashes, the decode worker's pulled blocks and the prefix index
    all carry the salt)."""

    def cached(prompt: str, salt: str | None) -> int:
        return _cached_tokens(http, prompt, salt)

    def remote() -> float:
        return sum(_metric(http, "baton:disagg_decisions_total", decision="remote"))

    for words in (40, 300):  # local prefill, then remote
        remote_before = remote()
        prompt = f"Salted prompt of {words} words:" + " hello" * words
        assert cached(prompt, "tenant-a") == 0
        assert cached(prompt, "tenant-a") >= words - 16  # (its full blocks)
        assert cached(prompt, "tenant-b") == 0
        assert cached(prompt, None) == 0
        assert cached(prompt, "tenant-b") >= words - 16
        # (the long prompt went to the prefill worker: the decode worker checked the salted
        # hashes of its KV handle; later runs go there too until the decode worker's pulled
        # blocks reach the prefix index)
        assert (remote() > remote_before) == (words == 300)
    empty = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "cache_salt": ""})
    assert empty.status_code == 400
    assert "'cache_salt' must be a non-empty string" in empty.json()["error"]["message"]


def test_logit_bias_and_allowed_token_ids(client: OpenAI, http: httpx.Client) -> None:
    """OpenAI's logit_bias (token ids as strings) and vLLM's allowed_token_ids reach the
    sampler; bad keys and ids out of the vocabulary are 400s."""
    banana = http.post("/tokenize", json={"prompt": " banana"}).json()["tokens"][0]
    args: dict[str, Any] = dict(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0)
    forced = client.chat.completions.create(
        logit_bias={str(banana): 100}, extra_body={"ignore_eos": True}, **args
    )
    assert forced.choices[0].message.content == " banana" * 5
    fruit = {
        " banana": banana,
        " apple": http.post("/tokenize", json={"prompt": " apple"}).json()["tokens"][0],
    }
    only = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=1.0,
        extra_body={"allowed_token_ids": list(fruit.values()), "ignore_eos": True},
    )  # fmt: skip
    text = only.choices[0].text
    assert text.replace(" banana", "").replace(" apple", "") == "" and len(text) >= 8 * 6, text
    for bad, param in (
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"allowed_token_ids": [99999999]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ):
        resp = http.post("/v1/chat/completions", json={**args, **bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_bad_words(http: httpx.Client) -> None:
    """vLLM's bad_words: the gateway tokenizes them (alone and after a space) and the worker
    never samples them; the rest of the request is served as before."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12}
    body |= {"temperature": 0, "ignore_eos": True}
    free = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "Paris" in free, free
    banned = http.post("/v1/completions", json={**body, "bad_words": ["Paris"]}).json()
    text = banned["choices"][0]["text"]
    assert "Paris" not in text and banned["usage"]["completion_tokens"] == 12
    assert text[: free.index("Paris")] == free[: free.index("Paris")]  # the same until there
    streamed = http.post("/v1/completions", json={**body, "bad_words": ["Paris"], "stream": True})
    chunks = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    for bad in ([""], ["x"] * 129, "Paris"):
        resp = http.post("/v1/completions", json={**body, "bad_words": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "bad_words", resp.text


def test_priority_needs_the_priority_policy(http: httpx.Client) -> None:
    """The shared server's workers schedule first come, first served: as vLLM, a request with a
    priority is refused there (the priority policy itself is tested on the workers)."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert http.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
    resp = http.post("/v1/completions", json={**body, "priority": -3})
    assert resp.status_code == 400 and "priority" in resp.json()["error"]["message"], resp.text


def test_cors(baton_server: Any) -> None:
    """As vLLM by default: any origin may call, and a browser's preflight is answered without
    the API key."""
    origin = {"Origin": "https://app.example"}
    preflight = httpx.options(
        f"{baton_server.base_url}/chat/completions",
        headers={**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"},
    )  # fmt: skip
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    models = httpx.get(
        f"{baton_server.base_url}/models",
        headers={**origin, "Authorization": f"Bearer {baton_server.api_key}"},
    )
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"


def test_tokenize_and_detokenize(client: OpenAI, http: httpx.Client) -> None:
    """vLLM's /tokenize gives the prompt ids the completion routes use; /detokenize inverts it."""
    chat = http.post("/tokenize", json={"model": MODEL, "messages": QUESTION}).json()
    assert chat["max_model_len"] == 512 and chat["count"] == len(chat["tokens"])
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert answer.usage is not None and answer.usage.prompt_tokens == chat["count"]
    prefix = http.post(
        "/tokenize",
        json={"messages": QUESTION, "add_generation_prompt": False, "return_token_strs": True},
    ).json()
    assert 0 < prefix["count"] < chat["count"]
    assert chat["tokens"][: prefix["count"]] == prefix["tokens"]
    assert len(prefix["token_strs"]) == prefix["count"] and chat["token_strs"] is None

    text = "The capital of France is"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_text.usage is not None and by_text.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    chat_text = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert QUESTION[0]["content"] in chat_text and "<|im_start|>" in chat_text  # specials kept

    for route, body, param in (
        ("/detokenize", {"tokens": [1, 10**7]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/tokenize", {"model": MODEL}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": QUESTION, "continue_final_message": True}, None),
    ):
        resp = http.post(route, json=body)
        assert resp.status_code == 400, (route, body, resp.text)
        assert resp.json()["error"]["param"] == param, resp.json()
    malformed = http.post("/tokenize", content=b'{"prompt": ', headers={"content-type": "x"})
    assert malformed.status_code == 400 and "invalid JSON" in malformed.json()["error"]["message"]
    wrong_model = http.post("/tokenize", json={"model": "no-such-model", "prompt": "x"})
    assert wrong_model.status_code == 404

    version = http.get("/version").json()["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", version)
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def _sse(http: httpx.Client, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed response."""
    with http.stream("POST", route, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def test_prompt_logprobs_and_token_ids(http: httpx.Client) -> None:
    """vLLM's prompt_logprobs and return_token_ids, on both routes; whole and streamed."""
    prompt = "One, two, three, four,"
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 5}
    out = http.post(
        "/v1/completions", json={**body, "prompt_logprobs": 2, "return_token_ids": True}
    ).json()
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == ids
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for token_id, entry in zip(ids[1:], plp[1:], strict=True):
        own = entry[str(token_id)]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        others = sorted(e["rank"] for t, e in entry.items() if t != str(token_id))
        assert others == [r for r in (1, 2) if r != own["rank"]]  # the top 2 besides its own
        assert next(iter(entry)) == str(token_id)  # its own first
    # The same values as an echo's logprobs of the prompt (a different path in the gateway).
    echo = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1}).json()
    echoed = echo["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]
    own_values = [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], plp[1:], strict=True)]
    assert own_values == pytest.approx(echoed, abs=1e-3)
    # token_ids: the output's ids, which decode to its text.
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"] == 5
    decoded = http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert decoded == choice["text"]
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    assert plain["text"] == choice["text"]
    assert not {"prompt_logprobs", "prompt_token_ids", "token_ids"} & set(plain)

    # Streamed, with n=2: each choice's prompt_token_ids once, its token_ids chunk by chunk.
    chunks = _sse(http, "/v1/completions", {**body, "n": 2, "return_token_ids": True})
    for index in (0, 1):
        mine = [c for ch in chunks for c in ch["choices"] if c["index"] == index]
        assert [c["prompt_token_ids"] for c in mine if "prompt_token_ids" in c] == [ids]
        assert [t for c in mine for t in c.get("token_ids", [])] == choice["token_ids"]
    streamed = http.post("/v1/completions", json={**body, "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"

    # Chat: prompt_logprobs and prompt_token_ids on the response, token_ids on the choice.
    chat_body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 6}
    chat_ids = http.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    whole = http.post(
        "/v1/chat/completions", json={**chat_body, "prompt_logprobs": 0, "return_token_ids": True}
    ).json()
    assert whole["prompt_token_ids"] == chat_ids
    assert len(whole["prompt_logprobs"]) == len(chat_ids) == whole["usage"]["prompt_tokens"]
    for token_id, entry in zip(chat_ids[1:], whole["prompt_logprobs"][1:], strict=True):
        assert list(entry) == [str(token_id)]  # prompt_logprobs=0: the token's own alone
    chunks = _sse(http, "/v1/chat/completions", {**chat_body, "return_token_ids": True})
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [chat_ids]
    tokens = [t for ch in chunks for c in ch["choices"] for t in c.get("token_ids", [])]
    assert tokens == whole["choices"][0]["token_ids"]
    assert len(tokens) == whole["usage"]["completion_tokens"]


def test_tokens_as_token_ids_and_truncation(http: httpx.Client) -> None:
    """return_tokens_as_token_ids names logprob tokens by id; truncate_prompt_tokens keeps the
    prompt's last tokens."""
    body = {"model": MODEL, "prompt": "One, two, three,", "temperature": 0, "max_tokens": 4}
    out = http.post(
        "/v1/completions",
        json={**body, "logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True},
    ).json()["choices"][0]
    assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
    for top in out["logprobs"]["top_logprobs"]:
        assert all(re.fullmatch(r"token_id:\d+", key) for key in top)
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": QUESTION,
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
    ).json()["choices"][0]["logprobs"]["content"]
    assert all(re.fullmatch(r"token_id:\d+", e["token"]) for e in chat) and len(chat) == 3

    long = "The quick brown fox jumps over the lazy dog. " * 3 + "The capital of France is"
    ids = http.post("/tokenize", json={"prompt": long}).json()["tokens"]
    tail = {**body, "prompt": ids[-6:]}
    want = http.post("/v1/completions", json=tail).json()["choices"][0]["text"]
    cut = http.post(
        "/v1/completions",
        json={**body, "prompt": long, "truncate_prompt_tokens": 6, "echo": True},
    ).json()
    assert cut["usage"]["prompt_tokens"] == 6
    echoed = http.post("/detokenize", json={"tokens": ids[-6:]}).json()["prompt"]
    assert cut["choices"][0]["text"] == echoed + want  # the echo is the prompt the model saw
    whole = http.post(
        "/v1/completions", json={**body, "prompt": long, "truncate_prompt_tokens": -1}
    )
    assert whole.json()["usage"]["prompt_tokens"] == len(ids)
    for bad in (513, 0):
        resp = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncate_prompt_tokens"


def test_request_ids(http: httpx.Client) -> None:
    """As vLLM with --enable-request-id-headers: X-Request-Id (else the body's request_id)
    names the response, and comes back as a header; clients may reuse an id."""
    body = {"model": MODEL, "prompt": "Hello, my name is", "temperature": 0, "max_tokens": 6}

    def post(headers: dict[str, str], **extra: Any) -> httpx.Response:
        return http.post("/v1/completions", json={**body, **extra}, headers=headers)

    resp = post({"X-Request-Id": "client-7"})
    assert resp.headers["x-request-id"] == "client-7" and resp.json()["id"] == "cmpl-client-7"
    assert post({}, request_id="body-3").json()["id"] == "cmpl-body-3"
    assert post({"X-Request-Id": "h"}, request_id="b").json()["id"] == "cmpl-h"  # as vLLM
    resp = post({})
    new_id = resp.headers["x-request-id"]  # the server's own, which the response id ends with
    assert re.fullmatch(r"[0-9a-f]{32}", new_id) and resp.json()["id"] == f"cmpl-{new_id}"
    chat = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 2},
        headers={"X-Request-Id": "chat-1"},
    )
    assert chat.json()["id"] == "chatcmpl-chat-1" and chat.headers["x-request-id"] == "chat-1"
    # Two requests at once under one id: the workers keep them apart.
    prompts = ["Hello, my name is", "The capital of France is"]
    want = [post({}, prompt=p).json()["choices"][0]["text"] for p in prompts]

    async def both() -> list[str]:
        async with httpx.AsyncClient(
            base_url=http.base_url, headers=http.headers, timeout=60
        ) as client:
            resps = await asyncio.gather(
                *(
                    client.post(
                        "/v1/completions",
                        json={**body, "prompt": p, "max_tokens": 16},
                        headers={"X-Request-Id": "dup"},
                    )
                    for p in prompts
                )
            )
        assert all(r.json()["id"] == "cmpl-dup" for r in resps)
        return [r.json()["choices"][0]["text"] for r in resps]

    got = asyncio.run(both())
    assert [g[: len(w)] for g, w in zip(got, want, strict=True)] == want
    assert http.get("/health").headers["x-request-id"]


def test_api_key_required(baton_server: Any) -> None:
    for key in ("wrong-key", None):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        resp = httpx.post(
            f"{baton_server.base_url}/chat/completions",
            json={"model": MODEL, "messages": QUESTION},
            headers=headers,
        )
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == 401
        models = httpx.get(f"{baton_server.base_url}/models", headers=headers)
        assert models.status_code == 401
    bad = OpenAI(base_url=baton_server.base_url, api_key="wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # Like vLLM, /health and /metrics stay open.
    assert httpx.get(f"{baton_server.root_url}/health").status_code == 200
    assert httpx.get(f"{baton_server.root_url}/metrics").status_code == 200


def test_disconnect_mid_stream_cancels_on_the_worker(
    client: OpenAI, http: httpx.Client, baton_server: Any
) -> None:
    worker = baton_server.decode_addr
    assert worker
    cancelled_before = sum(_metric(http, "baton:gateway_requests_total", status="cancelled"))

    def running() -> list[float]:
        return _metric(http, "baton:num_requests_running", worker=worker)

    def aborted() -> float:
        """Requests the worker ended by abort (as it counts them)."""
        labels = {"worker": worker, "finished_reason": "abort"}
        return sum(_metric(http, "baton:request_success_total", **labels))

    def worker_state() -> dict[str, list[float]]:
        """What the gateway's /metrics says of the worker (failures show it when they wait)."""
        names = ("num_requests_running", "num_requests_waiting", "gateway_worker_metrics_up")
        return {n: _metric(http, f"baton:{n}", worker=worker) for n in names}

    body = {
        "model": MODEL,
        "messages": STORY,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    aborted_before = aborted()
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        chunks = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line.removeprefix("data: ")))
            if len(chunks) >= 4:
                break
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # 400 tokens take seconds; the worker drops the request (an abort, not its end) before.
    _wait_for(lambda: aborted() == aborted_before + 1, 6, observe=worker_state)
    _wait_for(lambda: running() == [0.0], 6, observe=worker_state)
    _wait_for(
        lambda: (
            sum(_metric(http, "baton:gateway_requests_total", status="cancelled"))
            > cancelled_before
        ),
        5,
    )
    # The same for a non-streamed request whose client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json={**body, "stream": False}, timeout=1.5)
    _wait_for(lambda: aborted() == aborted_before + 2, 6, observe=worker_state)
    _wait_for(lambda: running() == [0.0], 6, observe=worker_state)
    ok = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert ok.choices[0].message.content


def test_metrics_include_workers(http: httpx.Client, baton_server: Any) -> None:
    text = http.get("/metrics").text
    worker = f'worker="{baton_server.decode_addr}"'
    for name in ("baton:num_requests_running", "baton:num_requests_waiting"):
        assert any(line.startswith(name + "{") and worker in line for line in text.splitlines())
    assert "baton:gateway_time_to_first_token_seconds_bucket" in text
    assert "baton:gateway_e2e_request_latency_seconds_count" in text
    assert _metric(http, "baton:gateway_requests_total", endpoint="chat", status="ok")
