"""The Responses API's mapping to chat requests, its store, and its stream events."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import ValidationError

from baton_gateway.errors import GatewayError
from baton_gateway.generation import SequenceDelta
from baton_gateway.protocol import ChatCompletionRequest
from baton_gateway.reading import ChatReading
from baton_gateway.reasoning import reasoning_use
from baton_gateway.responses_api import (
    BackgroundRun,
    OutputMessage,
    OutputText,
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    chat_request,
    input_messages,
    response_object,
    stopped,
)


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def test_input_items_become_chat_messages() -> None:
    """developer -> system; text parts joined; a function call joins the assistant message
    before it (or makes one); its output is a tool message."""
    req = request(
        input=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                ],
            },
            {"type": "message", "role": "assistant", "content": "Let me see."},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
        ]
    )
    messages = input_messages(req)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] == "a\nb"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[2]["content"] == "Let me see."
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "1"}
    assert messages[4]["content"] == "" and messages[4]["tool_calls"][0]["id"] == "c3"


def test_chat_request_mapping() -> None:
    schema = {"type": "object"}
    req = request(
        instructions="Be brief.",
        max_output_tokens=7,
        top_logprobs=2,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
        tools=[{"type": "function", "name": "f", "parameters": schema}],
        tool_choice="none",
        top_k=5,  # vLLM's extras pass through; unknown fields do not
        cache_salt="tenant-1",
        some_future_field=1,
    )
    chat = ChatCompletionRequest.model_validate(
        chat_request(req, [{"role": "user", "content": "0"}])
    )
    assert [m.role for m in chat.messages] == ["system", "user", "user"]
    assert chat.max_tokens == 7 and chat.num_logprobs == 2 and chat.top_k == 5
    assert chat.cache_salt == "tenant-1"
    assert chat.tools is not None and chat.tools[0].function.name == "f"
    assert chat.effective_tool_choice == "none"
    named = request(tools=req.tools, tool_choice={"type": "function", "name": "f"})
    chat = ChatCompletionRequest.model_validate(chat_request(named, []))
    assert chat.effective_tool_choice == "named" and chat.structured is not None
    assert chat.structured is not None and chat.structured.json_schema is not None
    assert "some_future_field" not in chat_request(req, [])
    plain = ChatCompletionRequest.model_validate(chat_request(request(), []))
    assert plain.tool_choice is None and plain.structured is None and plain.num_logprobs is None
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(chat_request(request(tool_choice="required"), []))
    bad: dict[str, Any]
    for bad in ({"input": []}, {"background": True, "store": False}, {"tools": [{"type": "x"}]}):
        with pytest.raises(ValidationError):
            request(**bad)


def test_store_keeps_the_most_recent() -> None:
    store = ResponseStore(2)
    for i in range(3):
        store.put(StoredResponse(response_object(request(), f"r{i}", "m"), []))
    assert store.get("r0") is None and store.get("r1") is not None and store.get("r2") is not None
    assert store.delete("r1") and not store.delete("r1") and store.get("r1") is None
    none = ResponseStore(0)
    none.put(StoredResponse(response_object(request(), "r", "m"), []))
    assert none.get("r") is None


def test_a_background_response_must_be_stored() -> None:
    assert request(background=True).background
    with pytest.raises(ValidationError, match="must be stored"):
        request(background=True, store=False)


def test_a_background_run_is_followed_from_any_event() -> None:
    """Readers get the events after the one they name, then each as it comes, and end with the
    run; a run that keeps no events (not streamed) only ends."""

    async def main() -> None:
        run = BackgroundRun(keep_events=True)
        run.emit("e0")
        run.emit("e1")

        async def read(starting_after: int) -> list[str]:
            return [event async for event in run.follow(starting_after)]

        readers = [asyncio.create_task(read(n)) for n in (-1, 0, 1, 5)]
        await asyncio.sleep(0)
        run.emit("e2")
        await asyncio.sleep(0)
        assert not any(reader.done() for reader in readers)  # (waiting for more)
        run.finish()
        everything = ["e0", "e1", "e2"]
        assert await asyncio.gather(*readers) == [everything, everything[1:], everything[2:], []]
        assert await read(-1) == everything  # (after the end too)

        quiet = BackgroundRun(keep_events=False)
        quiet.emit("e0")
        quiet.finish()
        assert quiet.events is None and quiet.done

    asyncio.run(main())


def test_a_stopped_response_keeps_its_output_as_incomplete() -> None:
    start = response_object(request(background=True), "resp_1", "m")
    message = OutputMessage(id="msg_1", content=[OutputText(text="Once upon")])
    cancelled = stopped(start, "cancelled", [message])
    assert cancelled.status == "cancelled" and cancelled.error is None and cancelled.background
    [item] = cancelled.output
    assert item.status == "incomplete" and item.content[0].text == "Once upon"
    failed = stopped(start, "failed", [], GatewayError(503, "no decode worker is available"))
    assert failed.status == "failed" and failed.output == []
    assert failed.error == {"code": "server_error", "message": "no decode worker is available"}
    refused = stopped(start, "failed", [], GatewayError(400, "too long"))
    assert refused.error is not None and refused.error["code"] == "invalid_prompt"


def _events(
    text_pieces: list[str], reading: ChatReading | None
) -> tuple[list[dict[str, Any]], Any]:
    reader = reading.new_reader() if reading is not None else None
    events = ResponseEvents(response_object(request(), "resp_1", "m"), reader, None)
    out = events.start()
    for i, piece in enumerate(text_pieces):
        last = i == len(text_pieces) - 1
        delta = SequenceDelta(0, piece, [1], None, finish_reason="stop" if last else None)
        out += events.feed(delta)
    out += events.close()
    parsed = [json.loads(e.split("data: ", 1)[1]) for e in out]
    for event, raw in zip(parsed, out, strict=True):
        assert raw.startswith(f"event: {event['type']}\n")
    return parsed, events.output


def test_stream_events_from_reasoning_to_content() -> None:
    """Reasoning then content: a reasoning item closed before the message item opens; the
    deltas add up to each item's text; sequence numbers count up."""
    use = reasoning_use(
        "qwen3", "<|im_start|>assistant\n<think>\n", include=True, constrained=False
    )
    parsed, output = _events(["Think", "ing.</th", "ink>\n\nHel", "lo!"], ChatReading(None, use))
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    kinds = [e["type"] for e in parsed]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    reasoning = "".join(e["delta"] for e in parsed if e["type"] == "response.reasoning_text.delta")
    content = "".join(e["delta"] for e in parsed if e["type"] == "response.output_text.delta")
    assert [item.type for item in output] == ["reasoning", "message"]
    assert reasoning == output[0].content[0].text == "Thinking."
    assert content == output[1].content[0].text and content.endswith("Hello!")
    assert all(item.status == "completed" for item in output)
    # Plain text (no reader): one message; an empty answer is still one.
    _, output = _events(["a", "b"], None)
    assert [item.content[0].text for item in output] == ["ab"]
    _, output = _events([""], None)
    assert [item.content[0].text for item in output] == [""]
