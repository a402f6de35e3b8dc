"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

:func:`send_request` never raises for a failed request (HTTP error, error event, broken stream,
timeout): it returns a :class:`RequestResult` with ``success=False`` and the error. Only
cancellation propagates.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from baton.bench.datasets import SampleRequest
from baton.bench.metrics import RequestResult
from baton.bench.sse import SSEDecoder, SSEError

_MAX_ERROR_BODY = 2000  # characters of an error response kept in the result


class StreamError(Exception):
    """The server answered, but not with a complete, valid stream (HTTP error status, error
    event, unexpected data)."""


@dataclass(frozen=True, slots=True)
class RequestConfig:
    """What every request of a benchmark shares."""

    url: str  # the endpoint, e.g. http://127.0.0.1:8000/v1/completions
    model: str
    chat: bool  # chat messages (chat/completions) rather than a prompt (completions)
    ignore_eos: bool
    timeout_s: float  # whole request, queueing on the server included
    api_key: str | None = None
    temperature: float = 0.0
    # Sent only when set; top_k and min_p are vLLM extras, at the body's top level.
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(cfg: RequestConfig, sample: SampleRequest) -> dict[str, Any]:
    """The JSON body for ``sample``: streamed, with usage, ``ignore_eos`` at top level (the vLLM
    extra) only when set."""
    payload: dict[str, Any] = {
        "model": cfg.model,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.chat:
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
        payload["max_completion_tokens"] = sample.output_len
    else:
        payload["prompt"] = sample.prompt
        payload["max_tokens"] = sample.output_len
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    for key in ("top_p", "top_k", "min_p"):
        if (value := getattr(cfg, key)) is not None:
            payload[key] = value
    return payload


def chunk_text(data: dict[str, Any], chat: bool) -> str:
    """The generated text in one stream chunk (first choice): ``delta.content`` for chat,
    ``text`` for completions; empty for role-only, finish-only and usage-only chunks."""
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return text if isinstance(text, str) else ""


class StreamTimer:
    """Timestamps the text chunks of one stream as its SSE payloads arrive.

    ``first`` is the arrival of the first chunk with non-empty text, ``itl`` the gaps between
    such chunks; role-only, finish-only and usage chunks are not timed. Times are whatever clock
    the caller passes as ``now`` (``perf_counter`` in :func:`send_request`).
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.first: float | None = None  # first text chunk
        self.last = start  # latest text chunk
        self.itl: list[float] = []
        self.texts: list[str] = []
        self.usage_tokens: int | None = None
        self.done = False

    def on_event(self, payload: str, now: float, chat: bool) -> None:
        """Apply one SSE payload; raises StreamError for an error event or data after [DONE]."""
        if self.done:
            raise StreamError("data after [DONE]")
        if payload == "[DONE]":
            self.done = True
            return
        data = json.loads(payload)
        if not isinstance(data, dict):
            raise StreamError(f"unexpected event: {payload[:200]}")
        if "error" in data:
            raise StreamError(f"error event: {json.dumps(data['error'])[:_MAX_ERROR_BODY]}")
        if text := chunk_text(data, chat):
            if self.first is None:
                self.first = now
            else:
                self.itl.append(now - self.last)
            self.last = now
            self.texts.append(text)
        usage = data.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]


async def _stream(
    client: httpx.AsyncClient, cfg: RequestConfig, state: StreamTimer, body: Any
) -> None:
    decoder = SSEDecoder()
    async with client.stream("POST", cfg.url, json=body, headers=cfg.headers()) as resp:
        if resp.status_code != 200:
            raw = b""
            async for part in resp.aiter_bytes():
                raw += part
                if len(raw) >= _MAX_ERROR_BODY:
                    break
            text = raw[:_MAX_ERROR_BODY].decode("utf-8", "replace")
            raise StreamError(f"HTTP {resp.status_code}: {text}")
        async for part in resp.aiter_bytes():
            now = time.perf_counter()
            for payload in decoder.feed(part):
                state.on_event(payload, now, cfg.chat)
        for payload in decoder.flush():
            state.on_event(payload, time.perf_counter(), cfg.chat)


async def send_request(
    client: httpx.AsyncClient, cfg: RequestConfig, sample: SampleRequest
) -> RequestResult:
    """Send ``sample`` as a streamed request and time it.

    Success needs HTTP 200, at least one text chunk, a ``[DONE]`` line and no error event.
    ``output_tokens`` comes from the usage block, else it is the number of text chunks.
    """
    state = StreamTimer(time.perf_counter())
    error = ""
    try:
        async with asyncio.timeout(cfg.timeout_s):
            await _stream(client, cfg, state, build_payload(cfg, sample))
        if state.first is None:
            error = "no text received"
        elif not state.done:
            error = "the stream ended without [DONE]"
    except TimeoutError:
        error = f"timed out after {cfg.timeout_s:g} s"
    except StreamError as e:
        error = str(e)
    except (httpx.HTTPError, SSEError, ValueError) as e:  # ValueError: malformed JSON
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    text = "".join(state.texts)
    output_tokens = state.usage_tokens if state.usage_tokens is not None else len(state.texts)
    return RequestResult(
        prompt_len=sample.prompt_len,
        success=not error,
        error=error,
        start=state.start,
        ttft=(state.first - state.start) if state.first is not None else 0.0,
        itl=state.itl,
        latency=end - state.start,
        output_tokens=output_tokens,
        generated_text=text,
    )
