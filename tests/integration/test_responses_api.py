"""OpenAI's Responses API on ``baton serve``, driven by the official ``openai`` SDK.

Each Responses request is served as the chat request it maps to, so greedy answers are checked
against ``/v1/chat/completions`` on the same conversation: the same text, the same prompt length.
The shared server (conftest.py) runs the hermes tool parser and the qwen3 reasoning parser.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France? Answer in a sentence."
# The Responses API's function tools are flat (no "function" wrapper as in chat).
WEATHER_FUNCTION: dict[str, Any] = {
    "type": "function",
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
}
# SmolLM2's template, ending the prompt inside a thinking block as Qwen3's thinking templates do.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n"
)


def _chat(client: OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
    )


def _stream(client: OpenAI, **kwargs: Any) -> tuple[list[Any], Any]:
    """A streamed response's events, checked for numbering, and its final response."""
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response


def test_text_whole_and_streamed(client: OpenAI) -> None:
    """A string input with instructions answers as the chat completion of [system, user]; the
    stream's events build the same message; max_output_tokens makes it incomplete."""
    chat = _chat(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
    )
    kwargs: dict[str, Any] = dict(
        model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    whole = client.responses.create(**kwargs)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.output_text == chat.choices[0].message.content
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert whole.usage is not None and chat.usage is not None
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    finished = chat.choices[0].finish_reason == "stop"
    assert whole.status == ("completed" if finished else "incomplete")
    assert whole.instructions == "Be brief." and whole.max_output_tokens == 12

    events, final = _stream(client, **kwargs)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens

    short = client.responses.create(**{**kwargs, "max_output_tokens": 2})
    assert short.status == "incomplete" and short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.usage is not None and short.usage.output_tokens == 2


def test_stored_conversation(client: OpenAI, http: httpx.Client) -> None:
    """previous_response_id continues a stored response's conversation (as chat would with the
    answer appended); stored responses can be read back and deleted; store=false keeps none."""
    first = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0
    )
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow_up = "And of Germany?"
    second = client.responses.create(
        model=MODEL,
        input=follow_up,
        previous_response_id=first.id,
        max_output_tokens=10,
        temperature=0,
    )
    chat = _chat(
        client,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": follow_up},
        ],
        max_tokens=10,
    )
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens

    deleted = http.delete(f"/v1/responses/{first.id}").json()
    assert deleted == {"id": first.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_calls_and_their_outputs(client: OpenAI) -> None:
    """A named tool choice gives one function_call item with valid arguments, streamed as
    argument deltas; its output, sent back after the call, gets a message answer."""
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        input="What is the weather like in Paris today?",
        tools=[WEATHER_FUNCTION],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    whole = client.responses.create(**kwargs)
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")

    events, final = _stream(client, **kwargs)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == call.arguments
    assert final.output[0].type == "function_call" and final.output[0].arguments == call.arguments

    answer = client.responses.create(
        model=MODEL,
        previous_response_id=whole.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}],
        tools=[WEATHER_FUNCTION],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage is not None and whole.usage is not None
    assert answer.usage.input_tokens > whole.usage.input_tokens  # the call and its output


def test_structured_output_reasoning_and_logprobs(client: OpenAI) -> None:
    """text.format json_schema constrains the text; a prompt that leaves <think> open (qwen3
    parser) gives a reasoning item, streamed as reasoning_text deltas; top_logprobs gives one
    logprob per output token."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    structured = client.responses.create(
        model=MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        max_output_tokens=40,
        temperature=0,
    )
    assert set(json.loads(structured.output_text)) == {"city"}
    assert structured.text is not None and structured.text.format.type == "json_schema"

    kwargs: dict[str, Any] = dict(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=16,
        temperature=0,
        extra_body={"chat_template": THINKING_TEMPLATE},
    )
    thinking = client.responses.create(**kwargs)
    [reasoning] = thinking.output  # SmolLM2 never closes the block: all of it is reasoning
    assert reasoning.type == "reasoning" and reasoning.content
    assert thinking.usage is not None
    reasoning_tokens = thinking.usage.output_tokens_details.reasoning_tokens
    assert abs(reasoning_tokens - thinking.usage.output_tokens) <= 1, reasoning_tokens
    events, final = _stream(client, **kwargs)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text == final.output[0].content[0].text

    scored = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=2
    )
    [text] = scored.output[0].content
    assert scored.usage is not None and len(text.logprobs or []) == scored.usage.output_tokens
    for entry in text.logprobs or []:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.token == entry.top_logprobs[0].token  # greedy


def test_request_errors(client: OpenAI, http: httpx.Client) -> None:
    """Unsupported tools and background are 400s naming their field, as are the chat
    request's own checks; an unknown model or stored response is a 404."""
    for fields, param in (
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"background": True}, "background"),
        ({"input": []}, "input"),
        ({"top_logprobs": 30}, "top_logprobs"),
        ({"temperature": -1}, "temperature"),
        ({"tool_choice": "required"}, None),  # without tools: "`tools` must be set"
    ):
        body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 2, **fields}
        resp = http.post("/v1/responses", json=body)
        assert resp.status_code == 400, (fields, resp.text)
        assert resp.json()["error"]["param"] == param, resp.json()
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=QUESTION)
    assert http.get("/v1/responses/resp_nothing").status_code == 404
    assert http.delete("/v1/responses/resp_nothing").status_code == 404
