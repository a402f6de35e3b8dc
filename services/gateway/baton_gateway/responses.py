"""Sequence deltas -> OpenAI response pieces: logprobs, usage, whole (non-streaming) responses.

Logprob token strings are each token decoded alone (as vLLM does), so a byte-level token holding
part of a UTF-8 character shows as U+FFFD; ``bytes`` are that string's UTF-8 bytes. A logprob of
-inf is written as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from baton_gateway.codec import TokenLogprob
from baton_gateway.generation import Generation, SequenceDelta
from baton_gateway.protocol import (
    MIN_LOGPROB,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessageOut,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    PromptTokenUsageInfo,
    UsageInfo,
)
from baton_gateway.reading import ChatReading
from baton_gateway.tools import ToolCallsSoFar


class TokenTexts:
    """Token id -> the token's text as logprobs show it; cached, the vocabulary is fixed."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


def _chat_logprob(texts: TokenTexts, token_id: int, value: float) -> ChatCompletionLogProb:
    token = texts(token_id)
    return ChatCompletionLogProb(
        token=token, logprob=clamp_logprob(value), bytes=list(token.encode("utf-8"))
    )


def chat_logprobs(texts: TokenTexts, logprobs: Iterable[TokenLogprob]) -> ChatCompletionLogProbs:
    """Chat logprobs for these sampled tokens, each with its top-N alternatives."""
    content = []
    for lp in logprobs:
        token = texts(lp.token_id)
        content.append(
            ChatCompletionLogProbsContent(
                token=token,
                logprob=clamp_logprob(lp.logprob),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[_chat_logprob(texts, tid, value) for tid, value in lp.top],
            )
        )
    return ChatCompletionLogProbs(content=content)


def completion_logprobs(
    texts: TokenTexts, logprobs: Iterable[TokenLogprob], text_offset: int
) -> tuple[CompletionLogProbs, int]:
    """Legacy completions logprobs for these tokens, and the text offset after them.

    ``text_offset`` is where the first token's text starts in the choice's text. Each
    ``top_logprobs`` entry holds the top N plus the sampled token, as in vLLM.
    """
    out = CompletionLogProbs()
    for lp in logprobs:
        token = texts(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(clamp_logprob(lp.logprob))
        out.text_offset.append(text_offset)
        text_offset += len(token)
        top = {texts(tid): clamp_logprob(value) for tid, value in lp.top}
        top.setdefault(token, clamp_logprob(lp.logprob))
        out.top_logprobs.append(top)
    return out, text_offset


def prompt_completion_logprobs(
    texts: TokenTexts, prompt_token_ids: list[int], prompt_logprobs: list[TokenLogprob]
) -> tuple[CompletionLogProbs, int]:
    """Legacy completions logprobs of an echoed prompt (the first token has none, as in vLLM),
    and the text offset after it."""
    first = texts(prompt_token_ids[0])
    head = CompletionLogProbs(
        tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0]
    )
    rest, offset = completion_logprobs(texts, prompt_logprobs, len(first))
    return joined(head, rest), offset


def joined(first: CompletionLogProbs, then: CompletionLogProbs | None) -> CompletionLogProbs:
    """``first``'s tokens followed by ``then``'s."""
    if then is None:
        return first
    return CompletionLogProbs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def usage_info(generation: Generation, num_prompt_tokens: int) -> UsageInfo:
    """Usage so far: ``num_prompt_tokens`` counts each prompt once, however many sequences."""
    completion = sum(generation.num_output_tokens.values())
    cached = generation.num_cached_tokens
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached) if cached else None,
    )


@dataclass
class ChoiceBuffer:
    """Everything one sequence produced, for a non-streaming response."""

    index: int
    prefix: str = ""  # echoed prompt text (completions)
    prompt_token_ids: list[int] = field(default_factory=list)  # echoed prompt tokens
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: SequenceDelta) -> None:
        self.parts.append(delta.text)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.parts)


def _chat_choice(
    c: ChoiceBuffer, texts: TokenTexts | None, reading: ChatReading | None
) -> ChatCompletionResponseChoice:
    message = ChatMessageOut(role="assistant", content=c.text)
    reason = c.finish_reason
    if reading is not None:
        # The streaming path's reader, fed the whole text: the same message either way.
        reader = reading.new_reader()
        read = reader.feed(c.text, final=True)
        calls = ToolCallsSoFar()
        calls.add(read.tool_calls)
        message = ChatMessageOut(
            content=read.content or None,
            tool_calls=calls.as_list(),
            reasoning=read.reasoning or None,
        )
        reason = reader.finish_reason(reason)
    return ChatCompletionResponseChoice(
        index=c.index,
        message=message,
        logprobs=chat_logprobs(texts, c.logprobs) if texts is not None else None,
        finish_reason=reason,
        stop_reason=c.stop_reason,
    )


def chat_response(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: Iterable[ChoiceBuffer],
    usage: UsageInfo,
    texts: TokenTexts | None,
    reading: ChatReading | None = None,
) -> ChatCompletionResponse:
    """A whole chat completion; ``texts`` is None when logprobs were not asked for,
    ``reading`` when the text is plain content."""
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=[_chat_choice(c, texts, reading) for c in sorted(choices, key=lambda c: c.index)],
        usage=usage,
    )


def completion_response(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: Iterable[ChoiceBuffer],
    usage: UsageInfo,
    texts: TokenTexts | None,
) -> CompletionResponse:
    """A whole text completion; ``texts`` is None when logprobs were not asked for."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        logprobs = None
        if texts is not None:
            logprobs, _ = completion_logprobs(texts, c.logprobs, len(c.prefix))
            if c.prompt_logprobs is not None and c.prompt_token_ids:
                echoed, _ = prompt_completion_logprobs(texts, c.prompt_token_ids, c.prompt_logprobs)
                logprobs = joined(echoed, logprobs)
        out.append(
            CompletionResponseChoice(
                index=c.index,
                text=c.text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    return CompletionResponse(id=request_id, created=created, model=model, choices=out, usage=usage)
