"""OpenAI's Responses API (``/v1/responses``), served through the chat pipeline as vLLM does.

A request's ``instructions`` and ``input`` (a string, or items: messages, earlier
``function_call`` items and their ``function_call_output``) become chat messages, which the
model's chat template renders; ``previous_response_id`` puts a stored response's conversation
before them (its instructions are not carried over, as in OpenAI's API). ``tools`` (functions),
``tool_choice``, ``text.format``, ``max_output_tokens``, ``top_logprobs`` and the sampling
fields, vLLM's extras included, become the chat request's, so tool calls, structured output and
reasoning (``--reasoning-parser``) work as they do for chat.

The output is a list of items: a ``reasoning`` item, a ``message`` with one ``output_text``, and
``function_call`` items, in the order the model wrote them. Streamed, they come as OpenAI's typed
events, from ``response.created`` to ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut the output).

Responses stored (``store``, the default) are kept in this gateway's memory, the most recent
``--max-stored-responses`` of them, for ``GET``/``DELETE /v1/responses/{id}`` and
``previous_response_id``; another gateway of the same stack does not see them.

A ``background`` response (stored) is answered at once, ``queued``; it runs on in the gateway
whether or not the client stays, ``GET /v1/responses/{id}`` shows how far it got, and ``POST
/v1/responses/{id}/cancel`` stops it. Streamed as well, its events are kept with it, so a client
that lost the stream picks it up again with ``GET /v1/responses/{id}?stream=true&starting_after=N``
(OpenAI's API, as vLLM serves it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from baton_gateway.errors import GatewayError
from baton_gateway.generation import SequenceDelta
from baton_gateway.protocol import (
    ChatCompletionLogProbsContent,
    DeltaToolCall,
    OpenAIBaseModel,
    ToolCall,
    UsageInfo,
    random_id,
)
from baton_gateway.reading import ChoiceReader
from baton_gateway.responses import TokenText, chat_logprobs
from baton_gateway.streaming import StreamOutcome

# ---------------------------------------------------------------------------------------------
# Requests


class TextPart(OpenAIBaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(OpenAIBaseModel):
    """A message; ``type`` may be left out (OpenAI's "easy" input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(OpenAIBaseModel):
    """A call the model made earlier (given back with the conversation)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    """What the client's function returned for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(OpenAIBaseModel):
    """Earlier reasoning given back; templates drop earlier turns' reasoning, so it is skipped."""

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(OpenAIBaseModel):
    type: Literal["function"] = "function"
    name: str


class TextFormat(OpenAIBaseModel):
    model_config = ConfigDict(serialize_by_alias=True)  # (echoed with "schema")

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


# vLLM's sampling and chat extras a Responses request may carry; they go to the chat request
# as they are (and are checked there).
_CHAT_EXTRAS = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "structured_outputs",
        "chat_template",
        "chat_template_kwargs",
        "request_id",
        "priority",
        "cache_salt",
        "include_reasoning",
    }
)


class ResponsesRequest(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")  # (vLLM's extras: _CHAT_EXTRAS)

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    # effort reaches the chat template as reasoning_effort; summary: accepted, not used
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    include: list[str] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _only_functions(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
            if kind != "function":
                raise ValueError(f"tools of type {kind!r} are not supported (functions only)")
        return tools

    @field_validator("input")
    @classmethod
    def _not_empty(cls, items: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(items, list) and not items:
            raise ValueError("must not be empty")
        return items

    @field_validator("background")
    @classmethod
    def _stored_if_background(cls, background: bool, info: ValidationInfo) -> bool:
        if background and not info.data.get("store", True):
            raise ValueError("a background response must be stored (store=true)")
        return background


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages (``developer`` becomes ``system``; a run of
    function calls joins the assistant message before it, or makes one)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, Any]] = []
    for item in request.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def chat_request(request: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request (as JSON) that serves ``request`` after ``history`` (the
    conversation of its ``previous_response_id``)."""
    instructions = [{"role": "system", "content": request.instructions}]
    fmt = request.text.format
    response_format: dict[str, Any] | None = None
    if fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
        response_format = {"type": "json_schema", "json_schema": schema}
    choice = request.tool_choice
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
        for t in request.tools
    ]
    body: dict[str, Any] = {
        **{k: v for k, v in (request.model_extra or {}).items() if k in _CHAT_EXTRAS},
        "model": request.model,
        "messages": [
            *(instructions if request.instructions else []),
            *history,
            *input_messages(request),
        ],
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": tools or None,
        "tool_choice": (
            {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, ToolChoiceFunction)
            else None
            if choice == "auto" and not tools  # (the default, with or without tools)
            else choice
        ),
        "parallel_tool_calls": request.parallel_tool_calls,
        "reasoning_effort": (request.reasoning or {}).get("effort"),
        "response_format": response_format,
        "logprobs": request.top_logprobs is not None,
        "top_logprobs": request.top_logprobs,
        "stream": request.stream,
        "user": request.user,
    }
    return body


# ---------------------------------------------------------------------------------------------
# Responses


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatCompletionLogProbsContent] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(OpenAIBaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallOutput(OpenAIBaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | ReasoningOutput | FunctionCallOutput


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool = False
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float | None = None
    text: TextConfig
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction
    tools: list[FunctionTool]
    top_p: float | None = None
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


def response_object(request: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    """The response as it starts: in progress, no output yet."""
    return ResponseObject(
        id=response_id,
        created_at=int(time.time()),
        status="in_progress",
        background=request.background,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        model=model,
        parallel_tool_calls=request.parallel_tool_calls,
        previous_response_id=request.previous_response_id,
        reasoning=request.reasoning,
        store=request.store,
        temperature=request.temperature,
        text=request.text,
        tool_choice=request.tool_choice,
        tools=request.tools,
        top_p=request.top_p,
        truncation=request.truncation,
        user=request.user,
        metadata=request.metadata or {},
    )


def finished(
    response: ResponseObject,
    output: list[OutputItem],
    usage: UsageInfo,
    finish_reason: str | None,
    count_tokens: Callable[[str], int],
) -> ResponseObject:
    """``response`` done with ``output``: incomplete when it ran out of tokens.
    ``reasoning_tokens`` counts the reasoning text's tokens (``count_tokens``)."""
    reasoning = "".join(
        part.text for item in output if isinstance(item, ReasoningOutput) for part in item.content
    )
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    incomplete = finish_reason == "length"
    return response.model_copy(
        update={
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens")
            if incomplete
            else None,
            "output": output,
            "usage": ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=cached),
                output_tokens=usage.completion_tokens,
                output_tokens_details=OutputTokensDetails(
                    reasoning_tokens=count_tokens(reasoning) if reasoning else 0
                ),
                total_tokens=usage.total_tokens,
            ),
        }
    )


def _function_call(call: ToolCall) -> FunctionCallOutput:
    return FunctionCallOutput(
        id=random_id("fc", "_"),
        call_id=call.id,
        name=call.function.name,
        arguments=call.function.arguments,
    )


def output_items(
    reasoning: str,
    content: str,
    calls: list[ToolCall],
    logprobs: list[ChatCompletionLogProbsContent],
    status: Literal["completed", "incomplete"],
) -> list[OutputItem]:
    """A whole response's output items: its reasoning, message and function calls."""
    items: list[OutputItem] = []
    if reasoning:
        items.append(
            ReasoningOutput(id=random_id("rs", "_"), content=[ReasoningText(text=reasoning)])
        )
    if content or not (reasoning or calls):
        text = OutputText(text=content, logprobs=logprobs)
        items.append(OutputMessage(id=random_id("msg", "_"), status=status, content=[text]))
    items += [_function_call(call) for call in calls]
    return items


def conversation_after(
    history: list[dict[str, Any]], request: ResponsesRequest, output: list[OutputItem]
) -> list[dict[str, Any]]:
    """The conversation a later ``previous_response_id`` continues: ``history``, this
    request's input, and its output as an assistant message (instructions left out)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if isinstance(item, OutputMessage):
            message["content"] = "".join(part.text for part in item.content)
        elif isinstance(item, ReasoningOutput):
            message["reasoning"] = "".join(part.text for part in item.content)
        else:
            call = {"name": item.name, "arguments": item.arguments}
            message.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
    return [*history, *input_messages(request), message]


def stopped(
    response: ResponseObject,
    status: Literal["failed", "cancelled"],
    output: list[OutputItem],
    error: GatewayError | None = None,
) -> ResponseObject:
    """``response`` ended before its output did: ``output`` is what it had (its items
    incomplete), ``error`` why it failed."""
    body = error.to_response().error if error is not None else None
    return response.model_copy(
        update={
            "status": status,
            "output": [item.model_copy(update={"status": "incomplete"}) for item in output],
            "error": None
            if body is None
            else {  # (OpenAI's codes: the request's fault, or the server's)
                "code": "server_error" if body.code >= 500 else "invalid_prompt",
                "message": body.message,
            },
        }
    )


class BackgroundRun:
    """A background response's run: its task and, when streamed, every event so far, which any
    number of readers follow (each from where it chooses)."""

    def __init__(self, keep_events: bool) -> None:
        self.events: list[str] | None = [] if keep_events else None
        self.task: asyncio.Task[str] | None = None  # (returns how it ended, for metrics)
        self.done = False
        self._wake = asyncio.Event()

    def emit(self, event: str) -> None:
        if self.events is not None:
            self.events.append(event)
            self._wake.set()
            self._wake = asyncio.Event()

    def finish(self) -> None:
        self.done = True
        self._wake.set()

    async def follow(self, starting_after: int = -1) -> AsyncGenerator[str, None]:
        """The events after sequence number ``starting_after``, then each as it comes, until the
        run ends."""
        assert self.events is not None
        sent = max(starting_after + 1, 0)
        while True:
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if self.done:
                return
            await self._wake.wait()


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]  # what previous_response_id continues
    run: BackgroundRun | None = None  # (background responses)

    @property
    def running(self) -> bool:
        return self.response.status in ("queued", "in_progress")


class ResponseStore:
    """The most recent ``capacity`` stored responses, by id (0: none kept)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


# ---------------------------------------------------------------------------------------------
# Streaming


def sse_typed_event(payload: dict[str, Any]) -> str:
    """One SSE event named by the payload's ``type``, as OpenAI sends them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


@dataclass
class _OpenItem:
    """An output item still being written: its index in ``output`` and its text so far."""

    index: int
    item: OutputItem
    parts: list[str] = field(default_factory=list)


class ResponseEvents:
    """Turns one choice's deltas into the Responses API's stream events.

    Each event gets the next ``sequence_number``. Reasoning text opens a reasoning item,
    content a message item, each tool call a function-call item; an item is finished (its
    ``.done`` events) when the next kind of output starts or the output ends.
    """

    def __init__(
        self,
        response: ResponseObject,
        reader: ChoiceReader | None,
        texts: TokenText | None,
    ) -> None:
        """``reader``: how the text splits into reasoning, content and tool calls (None: all
        content); ``texts`` names logprobs' tokens (None: no logprobs)."""
        self.response = response
        self._reader = reader
        self._texts = texts
        self._sequence = 0
        self.output: list[OutputItem] = []
        self._open: _OpenItem | None = None  # reasoning or message
        self._calls: dict[int, _OpenItem] = {}  # tool call index -> its item
        self.finish_reason: str | None = None
        self._logprobs_seen: list[ChatCompletionLogProbsContent] = []
        self._logprobs_unsent: list[ChatCompletionLogProbsContent] = []  # (for the next delta)

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_typed_event(payload)

    def _dump(self, model: OpenAIBaseModel) -> dict[str, Any]:
        return model.model_dump(mode="json")

    def start(self) -> list[str]:
        running = self.response.model_copy(update={"status": "in_progress"})
        return [
            self._event("response.created", response=self._dump(self.response)),
            self._event("response.in_progress", response=self._dump(running)),
        ]

    def _add(self, item: OutputItem) -> tuple[_OpenItem, str]:
        opened = _OpenItem(len(self.output), item)
        self.output.append(item)
        added = self._event(
            "response.output_item.added", output_index=opened.index, item=self._dump(item)
        )
        return opened, added

    def _text_events(self, kind: Literal["reasoning", "message"], text: str) -> list[str]:
        """Events for more reasoning or content text, opening its item if needed."""
        events: list[str] = []
        if self._open is not None and self._open.item.type != kind:
            events += self._close_open()
        if self._open is None:
            item: OutputItem
            if kind == "reasoning":
                item = ReasoningOutput(id=random_id("rs", "_"), status="in_progress")
                part: OpenAIBaseModel = ReasoningText(text="")
            else:
                item = OutputMessage(id=random_id("msg", "_"), status="in_progress")
                part = OutputText(text="")
            self._open, added = self._add(item)
            events += [
                added,
                self._event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=self._open.index,
                    content_index=0,
                    part=self._dump(part),
                ),
            ]
        self._open.parts.append(text)
        return events

    def _close_open(self) -> list[str]:
        opened, self._open = self._open, None
        if opened is None:
            return []
        text = "".join(opened.parts)
        where = {"item_id": opened.item.id, "output_index": opened.index, "content_index": 0}
        item = opened.item
        if isinstance(item, ReasoningOutput):
            part: OpenAIBaseModel = ReasoningText(text=text)
            done = [self._event("response.reasoning_text.done", **where, text=text)]
            item = item.model_copy(update={"content": [part], "status": "completed"})
        else:
            assert isinstance(item, OutputMessage)
            logprobs = self._logprobs_seen  # (all the output's, as a whole response has)
            part = OutputText(text=text, logprobs=logprobs)
            done = [
                self._event(
                    "response.output_text.done",
                    **where,
                    text=text,
                    logprobs=self._dump_all(logprobs),
                )
            ]
            item = item.model_copy(update={"content": [part], "status": self._status()})
        self.output[opened.index] = item
        return [
            *done,
            self._event("response.content_part.done", **where, part=self._dump(part)),
            self._event(
                "response.output_item.done", output_index=opened.index, item=self._dump(item)
            ),
        ]

    def _dump_all(self, models: list[ChatCompletionLogProbsContent]) -> list[dict[str, Any]]:
        return [self._dump(m) for m in models]

    def _status(self) -> Literal["completed", "incomplete"]:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def _call_events(self, pieces: list[DeltaToolCall]) -> list[str]:
        events = self._close_open()
        for piece in pieces:
            opened = self._calls.get(piece.index)
            if opened is None:
                call = FunctionCallOutput(
                    id=random_id("fc", "_"),
                    call_id=piece.id or random_id("call", "_"),
                    name=piece.function.name or "",
                    arguments="",
                    status="in_progress",
                )
                opened, added = self._add(call)
                self._calls[piece.index] = opened
                events.append(added)
            arguments = piece.function.arguments
            if arguments:
                opened.parts.append(arguments)
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=opened.item.id,
                        output_index=opened.index,
                        delta=arguments,
                    )
                )
        return events

    def _close_calls(self) -> list[str]:
        events = []
        for opened in self._calls.values():
            arguments = "".join(opened.parts)
            assert isinstance(opened.item, FunctionCallOutput)
            item = opened.item.model_copy(update={"arguments": arguments, "status": "completed"})
            self.output[opened.index] = item
            events += [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=opened.index,
                    name=item.name,
                    arguments=arguments,
                ),
                self._event(
                    "response.output_item.done", output_index=opened.index, item=self._dump(item)
                ),
            ]
        self._calls.clear()
        return events

    def feed(self, delta: SequenceDelta) -> list[str]:
        """The events for one delta (none while text is held back)."""
        final = delta.finish_reason is not None
        if final:
            self.finish_reason = delta.finish_reason
        if self._reader is None:
            reasoning, content, pieces = "", delta.text, []
        else:
            read = self._reader.feed(delta.text, final=final)
            reasoning, content, pieces = read.reasoning, read.content, read.tool_calls
        new_logprobs = []
        if self._texts is not None and delta.logprobs:
            new_logprobs = chat_logprobs(self._texts, delta.logprobs).content or []
        self._logprobs_seen += new_logprobs
        self._logprobs_unsent += new_logprobs
        events: list[str] = []
        if reasoning:
            events += self._text_events("reasoning", reasoning)
            events.append(self._delta("response.reasoning_text.delta", reasoning))
        if content:
            events += self._text_events("message", content)
            logprobs, self._logprobs_unsent = self._logprobs_unsent, []
            events.append(
                self._delta(
                    "response.output_text.delta", content, logprobs=self._dump_all(logprobs)
                )
            )
        if pieces:
            events += self._call_events(pieces)
        return events

    def _delta(self, kind: str, text: str, **extra: Any) -> str:
        assert self._open is not None
        where = {"item_id": self._open.item.id, "output_index": self._open.index}
        return self._event(kind, **where, content_index=0, delta=text, **extra)

    def end(self, response: ResponseObject) -> list[str]:
        """The closing events, given the finished ``response`` (from :meth:`close`)."""
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return [self._event(kind, response=self._dump(response))]

    def close(self) -> list[str]:
        """Finish every open item; ``output`` is then whole."""
        if not self.output:  # an empty answer is still a message
            self._text_events("message", "")
        return [*self._close_open(), *self._close_calls()]

    def error(self, error: GatewayError) -> str:
        body = error.to_response().error
        return self._event("error", code=str(body.code), message=body.message, param=body.param)


# Builds (and stores) the finished response from the output items and the finish reason.
Finish = Callable[[list[OutputItem], str | None], ResponseObject]


async def response_stream(
    events: ResponseEvents,
    first: SequenceDelta | None,
    rest: AsyncIterator[SequenceDelta],
    finish: Finish,
    outcome: StreamOutcome,
) -> AsyncGenerator[str, None]:
    """All of a streamed response's events (``first`` was taken from ``rest`` already);
    ``outcome`` is set when the stream ends. A failure mid-stream is an ``error`` event."""
    for event in events.start():
        yield event
    try:
        if first is not None:
            for event in events.feed(first):
                yield event
        async for delta in rest:
            for event in events.feed(delta):
                yield event
    except GatewayError as e:
        outcome.status = "error"
        outcome.error = e
        yield events.error(e)
        return
    for event in events.close():
        yield event
    for event in events.end(finish(events.output, events.finish_reason)):
        yield event
    outcome.status = "ok"
