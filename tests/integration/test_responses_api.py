"""OpenAI's Responses API on ``baton serve``, driven by the official ``openai`` SDK.

Each Responses request is served as the chat request it maps to, so greedy answers are checked
against ``/v1/chat/completions`` on the same conversation: the same text, the same prompt length.
The shared server (conftest.py) runs the hermes tool parser and the qwen3 reasoning parser.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
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
    """Unsupported tools and an unstored background response are 400s naming their field,
    as are the chat request's own checks; an unknown model or stored response is a 404."""
    for fields, param in (
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"background": True, "store": False}, "background"),
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
    assert http.post("/v1/responses/resp_nothing/cancel").status_code == 404
    synchronous = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(synchronous.id)
    # Only a background response that was streamed can be streamed again.
    resp = http.get(f"/v1/responses/{synchronous.id}", params={"stream": "true"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"


def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def _worker_aborts(http: httpx.Client) -> float:
    """The requests the decode worker ended by abort (the gateway's /metrics shows its)."""
    pattern = re.compile(r'^baton:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)')
    lines = http.get("/metrics").text.splitlines()
    return sum(float(m.group(1)) for line in lines if (m := pattern.match(line)))


def test_background_response_runs_to_the_end(client: OpenAI) -> None:
    """background=true answers at once, queued; the response runs on in the gateway and, read
    back, ends as the same request in the foreground does."""
    kwargs: dict[str, Any] = dict(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    foreground = client.responses.create(**kwargs)
    queued = client.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background and queued.output == []
    seen = {queued.status}

    def ended() -> bool:
        seen.add(client.responses.retrieve(queued.id).status)
        return not seen.isdisjoint({"completed", "incomplete", "failed", "cancelled"})

    _wait_for(ended, 60, "the background response's end")
    done = client.responses.retrieve(queued.id)
    assert done.status == foreground.status, done.error
    assert done.output_text == foreground.output_text and done.background
    assert done.usage is not None and foreground.usage is not None
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert seen <= {"queued", "in_progress", done.status}, seen
    # Finished, it is continued as any stored response.
    follow_up = client.responses.create(
        model=MODEL, input="Thanks.", previous_response_id=done.id, max_output_tokens=2
    )
    assert follow_up.usage is not None and follow_up.usage.input_tokens > done.usage.input_tokens


def test_cancelling_a_background_response(client: OpenAI, http: httpx.Client) -> None:
    """Cancel stops a running background response on the worker (an abort there) and keeps
    what it wrote so far; cancelling again answers the same; deleting one that runs stops it."""
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        input="Tell me a long story about a dragon.",
        max_output_tokens=400,
        extra_body={"ignore_eos": True},
    )
    aborts = _worker_aborts(http)
    running = client.responses.create(background=True, **kwargs)
    _wait_for(
        lambda: client.responses.retrieve(running.id).status == "in_progress",
        30,
        "the background response running",
    )
    time.sleep(0.5)  # (some text first: 400 tokens take far longer on this model)
    with pytest.raises(openai.BadRequestError, match="has not finished"):
        client.responses.create(model=MODEL, input="x", previous_response_id=running.id)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.usage is None
    [message] = cancelled.output
    assert message.type == "message" and message.status == "incomplete"
    assert message.content[0].text  # (written before the cancel)
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"
    _wait_for(lambda: _worker_aborts(http) == aborts + 1, 10, "the worker's abort")

    deleted = client.responses.create(background=True, **kwargs)
    http.delete(f"/v1/responses/{deleted.id}").raise_for_status()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)
    _wait_for(lambda: _worker_aborts(http) == aborts + 2, 10, "the worker's second abort")
    ok = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    assert ok.status == "incomplete"


def test_a_background_stream_can_be_picked_up_again(client: OpenAI) -> None:
    """A streamed background response runs on after its client goes; the stream read again
    from after any event's sequence number gives the rest, to the same end."""
    kwargs: dict[str, Any] = dict(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    foreground = client.responses.create(**kwargs)
    with client.responses.create(background=True, stream=True, **kwargs) as stream:
        received = iter(stream)
        first = [next(received) for _ in range(4)]
    assert [e.sequence_number for e in first] == [0, 1, 2, 3]
    assert first[0].type == "response.created" and first[0].response.status == "queued"
    assert first[1].type == "response.in_progress"
    response_id = first[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=3))
    assert [e.sequence_number for e in rest] == list(range(4, 4 + len(rest)))
    assert rest[-1].type in ("response.completed", "response.incomplete")
    events = [*first, *rest]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == foreground.output_text == rest[-1].response.output_text
    # From the start, once it has ended: every event again.
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
