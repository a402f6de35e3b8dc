"""Server-sent events for streamed completions.

Chat: a first chunk per choice carries ``{"role": "assistant", "content": ""}`` (the answer's
role), then any echoed text (``echo``: the continued last message); then one chunk
per delta with new text (or logprobs); a choice's last chunk carries its ``finish_reason``; with
``stream_options.include_usage`` a final chunk with no choices carries the usage; then
``data: [DONE]``. Text completions stream the same way (``echo`` sends the prompt text first).
With ``return_token_ids``, a choice's first chunk carries ``prompt_token_ids`` and each chunk its
new ``token_ids`` (a chunk goes out for new tokens even when their text is held back).
A failure after the response started is sent as an ``{"error": ...}`` event before ``[DONE]``.

:class:`SSEResponse` cancels the stream as soon as the client disconnects (not only at the next
write), and always closes it, so the gRPC calls behind it are cancelled right away.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from baton_gateway.errors import GatewayError
from baton_gateway.generation import Generation, SequenceDelta
from baton_gateway.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionLogProbs,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
)
from baton_gateway.reading import ChatReading, ChoiceReader
from baton_gateway.responses import (
    Outputs,
    chat_logprobs,
    completion_logprobs,
    joined,
    prompt_completion_logprobs,
    usage_info,
)

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: str) -> str:
    """One SSE event carrying ``payload`` (JSON, which has no raw newlines)."""
    return f"data: {payload}\n\n"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response over an async generator of events.

    The generator is cancelled when the client disconnects (Starlette alone would notice only
    when a write fails, which may be long after when tokens are slow) and closed however the
    response ends, so its ``finally`` blocks run before this returns.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream_then_stop() -> None:
                    with suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            # Closing a generator that never started skips its finally blocks: hence on_close.
            await self._events.aclose()
            if self._on_close is not None:
                await self._on_close()


@dataclass(slots=True)
class StreamOutcome:
    """How a stream ended, for metrics: "ok", "error", or "cancelled" (client disconnect);
    ``error``: the error the stream ended with."""

    status: str = "cancelled"
    error: GatewayError | None = None


@dataclass(frozen=True, slots=True)
class StreamContext:
    """What every chunk of one response shares."""

    request_id: str
    created: int
    model: str
    num_choices: int  # all choices (prompts x n)
    num_prompt_tokens: int
    include_usage: bool
    continuous_usage: bool
    outputs: Outputs


async def _chain(
    first: SequenceDelta | None, rest: AsyncIterator[SequenceDelta]
) -> AsyncIterator[SequenceDelta]:
    if first is not None:
        yield first
    async for delta in rest:
        yield delta


def _error_event(error: GatewayError) -> str:
    return sse_event(error.to_response().model_dump_json())


async def _stream(
    ctx: StreamContext,
    generation: Generation,
    first: SequenceDelta | None,
    rest: AsyncGenerator[SequenceDelta, None],
    outcome: StreamOutcome,
    event: Callable[[list[Any], UsageInfo | None], str],
    prelude: list[str],
    to_choice: Callable[[SequenceDelta], Any | None],
) -> AsyncGenerator[str, None]:
    """The events shared by both endpoints: ``prelude``, one chunk per delta that
    ``to_choice`` turns into a choice (None: held back, nothing to show yet), then the usage
    chunk if asked for and ``[DONE]``; an error mid-stream becomes an error event."""
    async with aclosing(rest):
        for prelude_event in prelude:
            yield prelude_event
        try:
            async for delta in _chain(first, rest):
                choice = to_choice(delta)
                if choice is None:
                    continue
                usage = None
                if ctx.continuous_usage:
                    usage = usage_info(generation, ctx.num_prompt_tokens)
                yield event([choice], usage)
        except GatewayError as e:
            outcome.status = "error"
            yield _error_event(e)
            yield SSE_DONE
            return
        if ctx.include_usage:
            yield event([], usage_info(generation, ctx.num_prompt_tokens))
        outcome.status = "ok"
        yield SSE_DONE


def chat_stream(
    ctx: StreamContext,
    generation: Generation,
    first: SequenceDelta | None,
    rest: AsyncGenerator[SequenceDelta, None],
    outcome: StreamOutcome,
    reading: ChatReading | None = None,
    role: str = "assistant",
    echo: dict[int, str] | None = None,
) -> AsyncGenerator[str, None]:
    """The SSE events of a streamed chat completion. ``first`` was already taken from ``rest``
    (so that a failure to start is answered with a proper HTTP status); ``outcome`` is set when
    the stream ends. With ``reading``, each choice's text goes through its own reader, whose
    pieces become ``delta.reasoning``, ``delta.content`` and ``delta.tool_calls``. Each
    choice's first chunk carries ``role``; ``echo`` (choice index -> text) is sent as content
    right after those, before the generated text (and never read as model output)."""

    outputs = ctx.outputs

    def event(
        choices: list[Any], usage: UsageInfo | None, prompt_token_ids: list[int] | None = None
    ) -> str:
        chunk = ChatCompletionStreamResponse(
            id=ctx.request_id,
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_token_ids,
        )
        return sse_event(chunk.model_dump_json())

    readers: dict[int, ChoiceReader] = {}

    def to_choice(delta: SequenceDelta) -> ChatCompletionResponseStreamChoice | None:
        logprobs = None
        if outputs.texts is not None and delta.logprobs:
            logprobs = chat_logprobs(outputs.texts, delta.logprobs)
        reason = delta.finish_reason
        message = DeltaMessage(content=delta.text or None)
        if reading is not None:
            reader = readers.get(delta.index)
            if reader is None:
                reader = readers[delta.index] = reading.new_reader()
            read = reader.feed(delta.text, final=reason is not None)
            message = DeltaMessage(
                content=read.content or None,
                tool_calls=read.tool_calls or None,
                reasoning=read.reasoning or None,
            )
            reason = reader.finish_reason(reason)
        token_ids = delta.token_ids if outputs.token_ids and delta.token_ids else None
        empty = message.content is None and message.tool_calls is None and not message.reasoning
        if empty and logprobs is None and reason is None and token_ids is None:
            return None
        return ChatCompletionResponseStreamChoice(
            index=delta.index,
            delta=message,
            logprobs=logprobs,
            finish_reason=reason,
            stop_reason=delta.stop_reason,
            token_ids=token_ids,
        )

    usage = usage_info(generation, ctx.num_prompt_tokens) if ctx.continuous_usage else None
    prompt = generation.prompt_token_ids(0) if outputs.token_ids else None

    def opening(index: int, delta: DeltaMessage) -> ChatCompletionResponseStreamChoice:
        return ChatCompletionResponseStreamChoice(index=index, delta=delta)

    prelude = [
        event([opening(i, DeltaMessage(role=role, content=""))], usage, prompt)
        for i in range(ctx.num_choices)
    ]
    prelude += [
        event([opening(i, DeltaMessage(content=text))], usage)
        for i, text in sorted((echo or {}).items())
    ]
    return _stream(ctx, generation, first, rest, outcome, event, prelude, to_choice)


def completion_stream(
    ctx: StreamContext,
    generation: Generation,
    echo: dict[int, str],
    first: SequenceDelta | None,
    rest: AsyncGenerator[SequenceDelta, None],
    outcome: StreamOutcome,
) -> AsyncGenerator[str, None]:
    """The SSE events of a streamed text completion; ``echo`` maps a choice index to the
    prompt text sent before its generated text. Otherwise as :func:`chat_stream`."""

    def event(choices: list[Any], usage: UsageInfo | None) -> str:
        chunk = CompletionStreamResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
        )
        return sse_event(chunk.model_dump_json())

    outputs, texts = ctx.outputs, ctx.outputs.texts
    offsets = {index: len(text) for index, text in echo.items()}
    # With logprobs, an echoed prompt goes out with its first delta, which brings the prompt's
    # logprobs; without, it goes out first.
    pending_echo = dict(echo) if texts is not None else {}
    # return_token_ids: the choices whose prompt_token_ids are still to be sent
    unsent_prompts = set(range(ctx.num_choices)) if outputs.token_ids else set()

    def prompt_ids(index: int) -> list[int] | None:
        if index not in unsent_prompts:
            return None
        unsent_prompts.discard(index)
        return generation.prompt_token_ids(index)

    def to_choice(delta: SequenceDelta) -> CompletionResponseChoice | None:
        logprobs: CompletionLogProbs | None = None
        text = delta.text
        if texts is not None and delta.logprobs:
            logprobs, offsets[delta.index] = completion_logprobs(
                texts, delta.logprobs, offsets.get(delta.index, 0)
            )
        echoed = pending_echo.pop(delta.index, None)
        if echoed is not None:
            assert texts is not None
            text = echoed + text
            if delta.prompt_logprobs is not None:
                head, _ = prompt_completion_logprobs(
                    texts,
                    generation.prompt_token_ids(delta.index),
                    delta.prompt_logprobs,
                    outputs.num_logprobs,
                )
                logprobs = joined(head, logprobs)
        token_ids = delta.token_ids if outputs.token_ids and delta.token_ids else None
        if not text and logprobs is None and delta.finish_reason is None and token_ids is None:
            return None
        return CompletionResponseChoice(
            index=delta.index,
            text=text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            prompt_token_ids=prompt_ids(delta.index),
            token_ids=token_ids,
        )

    prelude = [
        event(
            [CompletionResponseChoice(index=index, text=text, prompt_token_ids=prompt_ids(index))],
            None,
        )
        for index, text in sorted(echo.items())
        if index not in pending_echo
    ]
    return _stream(ctx, generation, first, rest, outcome, event, prelude, to_choice)
