"""One request's sequences on the decode workers: token ids in, text deltas out.

A request becomes one Generate call per sequence (``n`` per prompt). Each sequence's tokens are
detokenized incrementally (UTF-8 safe) with stop strings held back, so no part of a stop string
is ever released; when a stop string matches, the sequence ends with finish reason "stop" and its
gRPC call is cancelled, which aborts the request on the worker. Closing :meth:`Generation.stream`
early (a client disconnect) cancels every call still open.

Token accounting follows vLLM: the token that completes a stop string is counted, later tokens
of the same message are dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from baton import tracing
from baton.v1 import engine_pb2
from baton_engine.detokenizer import IncrementalDetokenizer
from baton_gateway.client import WorkerPool
from baton_gateway.codec import TokenLogprob
from baton_gateway.errors import GatewayError


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """One sequence to run: its choice index, its prompt and its Generate request."""

    index: int
    prompt_token_ids: list[int]
    request: engine_pb2.GenerateRequest


@dataclass(frozen=True, slots=True)
class TextOptions:
    """How token ids become text for every sequence of a request."""

    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass(frozen=True, slots=True)
class SequenceDelta:
    """What one sequence produced since its previous delta.

    ``text`` may be empty (held back for a stop string or an incomplete character) while
    ``token_ids`` is not. The last delta of a sequence has ``finish_reason`` set.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first delta, when asked for


class Generation:
    """Runs ``specs`` on ``pool`` and yields their deltas in arrival order.

    Counters (read them once the stream is done, or while it runs for continuous usage):
    ``num_output_tokens[index]``, ``num_cached_tokens`` (of the first sequence to report it),
    ``first_token_time`` (``time.monotonic()`` of the first delta with tokens, or None).
    """

    def __init__(
        self,
        pool: WorkerPool,
        tokenizer: Any,
        specs: Sequence[SequenceSpec],
        options: TextOptions,
        trace_parent: tracing.Context | None = None,
    ) -> None:
        self._pool = pool
        self._trace_parent = trace_parent
        self._tokenizer = tokenizer
        self._specs = list(specs)
        self._options = options
        self.num_output_tokens: dict[int, int] = {s.index: 0 for s in self._specs}
        self.num_cached_tokens: int | None = None
        self.first_token_time: float | None = None

    def prompt_token_ids(self, index: int) -> list[int]:
        """The prompt of the sequence with choice ``index``."""
        return next(s.prompt_token_ids for s in self._specs if s.index == index)

    async def stream(self) -> AsyncGenerator[SequenceDelta, None]:
        """Yield every sequence's deltas; raises GatewayError when a call fails (the other
        calls are cancelled then). Use it inside ``aclosing`` so an early exit cancels the calls
        at once rather than when the generator is collected."""
        if len(self._specs) == 1:
            async with aclosing(self._run(self._specs[0])) as deltas:
                async for delta in deltas:
                    yield delta
            return
        async with aclosing(self._merged()) as deltas:
            async for delta in deltas:
                yield delta

    async def _merged(self) -> AsyncGenerator[SequenceDelta, None]:
        queue: asyncio.Queue[SequenceDelta | BaseException | None] = asyncio.Queue()

        async def pump(spec: SequenceSpec) -> None:
            try:
                async with aclosing(self._run(spec)) as deltas:
                    async for delta in deltas:
                        queue.put_nowait(delta)
            except Exception as e:  # handed to the consumer, which raises it
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(spec)) for spec in self._specs]
        try:
            num_running = len(tasks)
            while num_running:
                item = await queue.get()
                if item is None:
                    num_running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, spec: SequenceSpec) -> AsyncGenerator[SequenceDelta, None]:
        opts = self._options
        detok = IncrementalDetokenizer(
            self._tokenizer,
            spec.prompt_token_ids,
            skip_special_tokens=opts.skip_special_tokens,
            stop=opts.stop,
            include_stop_str_in_output=opts.include_stop_str_in_output,
        )
        async with aclosing(self._pool.generate(spec.request, self._trace_parent)) as chunks:
            async for chunk in chunks:
                plp = chunk.prompt_logprobs
                if self.num_cached_tokens is None:
                    self.num_cached_tokens = chunk.num_cached_tokens
                if chunk.token_ids and self.first_token_time is None:
                    self.first_token_time = time.monotonic()
                ids = chunk.token_ids
                final = chunk.finish_reason is not None
                # The worker stopped at its last token (EOS or a stop token id; stop strings
                # are found here): the detokenizer leaves its text out, as vLLM.
                at_stop_token = chunk.finish_reason == "stop"
                stop_str: str | None = None
                if opts.stop:
                    # Token by token, to find the one that completes a stop string.
                    parts = []
                    for i, token_id in enumerate(ids):
                        last = final and i == len(ids) - 1
                        released = detok.update(
                            (token_id,), final=last, stop_terminated=last and at_stop_token
                        )
                        parts.append(released.text)
                        if released.stop_str is not None:
                            stop_str, ids = released.stop_str, ids[: i + 1]
                            break
                    if not ids and final:
                        released = detok.update((), final=True)
                        parts.append(released.text)
                        stop_str = released.stop_str
                    text = "".join(parts)
                else:
                    text = detok.update(ids, final=final, stop_terminated=at_stop_token).text
                logprobs = chunk.logprobs[: len(ids)] if chunk.logprobs is not None else None
                self.num_output_tokens[spec.index] += len(ids)
                if stop_str is not None:
                    # Returning closes `chunks`, which cancels the call: the worker aborts it.
                    yield SequenceDelta(spec.index, text, ids, logprobs, "stop", stop_str, plp)
                    return
                if final:
                    yield SequenceDelta(
                        spec.index,
                        text,
                        ids,
                        logprobs,
                        chunk.finish_reason,
                        chunk.stop_token_id,
                        plp,
                    )
                    return
                yield SequenceDelta(spec.index, text, ids, logprobs, prompt_logprobs=plp)
        raise GatewayError(
            HTTPStatus.BAD_GATEWAY, "the decode worker ended the stream without a finish reason"
        )
