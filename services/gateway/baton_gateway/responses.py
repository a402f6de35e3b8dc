"""Sequence deltas -> OpenAI response pieces: logprobs, usage, whole (non-streaming) responses.

Logprob token strings are each token decoded alone (as vLLM does), so a byte-level token holding
part of a UTF-8 character shows as U+FFFD; ``bytes`` are that string's UTF-8 bytes. With
``return_tokens_as_token_ids`` they are ``"token_id:{id}"`` instead. A logprob of -inf is written
as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
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
    PromptLogprob,
    PromptLogprobs,
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


# How logprobs name a token: its text (TokenTexts), or token_id_text.
TokenText = Callable[[int], str]


def token_id_text(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids`` spelling of a token."""
    return f"token_id:{token_id}"


@dataclass(frozen=True, slots=True)
class Outputs:
    """What a request asked to see besides the text."""

    texts: TokenText | None = None  # names tokens in logprobs; None: no logprobs
    num_logprobs: int = 0  # top N per sampled (and echoed prompt) token
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top N per prompt token
    token_ids: bool = False  # vLLM's return_token_ids


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


def prompt_logprobs(texts: TokenText, logprobs: Iterable[TokenLogprob], num: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` from the logprobs of prompt tokens 1..: None for token 0, then
    each token's own logprob (with its rank) followed by the top ``num`` it is not among."""
    out: PromptLogprobs = [None]
    for lp in logprobs:
        entry = {lp.token_id: PromptLogprob(
            logprob=clamp_logprob(lp.logprob), rank=lp.rank, decoded_token=texts(lp.token_id)
        )}  # fmt: skip
        for rank, (tid, value) in enumerate(lp.top[:num], start=1):
            entry.setdefault(
                tid,
                PromptLogprob(logprob=clamp_logprob(value), rank=rank, decoded_token=texts(tid)),
            )
        out.append(entry)
    return out


def _chat_logprob(texts: TokenText, token_id: int, value: float) -> ChatCompletionLogProb:
    token = texts(token_id)
    return ChatCompletionLogProb(
        token=token, logprob=clamp_logprob(value), bytes=list(token.encode("utf-8"))
    )


def chat_logprobs(texts: TokenText, logprobs: Iterable[TokenLogprob]) -> ChatCompletionLogProbs:
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
    texts: TokenText, logprobs: Iterable[TokenLogprob], text_offset: int, num: int | None = None
) -> tuple[CompletionLogProbs, int]:
    """Legacy completions logprobs for these tokens, and the text offset after them.

    ``text_offset`` is where the first token's text starts in the choice's text. Each
    ``top_logprobs`` entry holds the top ``num`` (None: all given) plus the sampled token, as
    in vLLM.
    """
    out = CompletionLogProbs()
    for lp in logprobs:
        token = texts(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(clamp_logprob(lp.logprob))
        out.text_offset.append(text_offset)
        text_offset += len(token)
        top = {texts(tid): clamp_logprob(value) for tid, value in lp.top[:num]}
        top.setdefault(token, clamp_logprob(lp.logprob))
        out.top_logprobs.append(top)
    return out, text_offset


def prompt_completion_logprobs(
    texts: TokenText, prompt_token_ids: list[int], logprobs: list[TokenLogprob], num: int
) -> tuple[CompletionLogProbs, int]:
    """Legacy completions logprobs (top ``num``) of an echoed prompt (the first token has none,
    as in vLLM), and the text offset after it."""
    first = texts(prompt_token_ids[0])
    head = CompletionLogProbs(
        tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0]
    )
    rest, offset = completion_logprobs(texts, logprobs, len(first), num)
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
    prompt_token_ids: list[int]
    # The text the answer starts with: a completion's prompt (echo), or a chat answer's
    # continued last message (echo); not the model's output, so chat never parses it.
    echo: str | None = None
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: SequenceDelta) -> None:
        self.parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    @property
    def generated(self) -> str:
        return "".join(self.parts)

    @property
    def text(self) -> str:
        return (self.echo or "") + self.generated

    def prompt_logprobs_out(self, texts: TokenText, outputs: Outputs) -> PromptLogprobs | None:
        if outputs.prompt_logprobs is None or self.prompt_logprobs is None:
            return None
        return prompt_logprobs(texts, self.prompt_logprobs, outputs.prompt_logprobs)


def _chat_choice(
    c: ChoiceBuffer, outputs: Outputs, reading: ChatReading | None, role: str
) -> ChatCompletionResponseChoice:
    message = ChatMessageOut(role=role, content=c.generated)
    reason = c.finish_reason
    if reading is not None:
        # The streaming path's reader, fed the whole text: the same message either way.
        reader = reading.new_reader()
        read = reader.feed(c.generated, final=True)
        calls = ToolCallsSoFar()
        calls.add(read.tool_calls)
        message = ChatMessageOut(
            role=role,
            content=read.content or None,
            tool_calls=calls.as_list(),
            reasoning=read.reasoning or None,
        )
        reason = reader.finish_reason(reason)
    if c.echo:
        message.content = c.echo + (message.content or "")
    texts = outputs.texts
    return ChatCompletionResponseChoice(
        index=c.index,
        message=message,
        logprobs=chat_logprobs(texts, c.logprobs) if texts is not None else None,
        finish_reason=reason,
        stop_reason=c.stop_reason,
        token_ids=c.token_ids if outputs.token_ids else None,
    )


def chat_response(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: Iterable[ChoiceBuffer],
    usage: UsageInfo,
    outputs: Outputs,
    names: TokenText,
    reading: ChatReading | None = None,
    role: str = "assistant",
) -> ChatCompletionResponse:
    """A whole chat completion; ``names`` gives prompt logprobs' ``decoded_token``,
    ``reading`` is None when the text is plain content, ``role`` is the messages' role."""
    ordered = sorted(choices, key=lambda c: c.index)
    first = ordered[0]  # a chat completion has one prompt
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=[_chat_choice(c, outputs, reading, role) for c in ordered],
        usage=usage,
        prompt_logprobs=first.prompt_logprobs_out(names, outputs),
        prompt_token_ids=first.prompt_token_ids if outputs.token_ids else None,
    )


def completion_response(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: Iterable[ChoiceBuffer],
    usage: UsageInfo,
    outputs: Outputs,
    names: TokenText,
) -> CompletionResponse:
    """A whole text completion; ``names`` gives prompt logprobs' ``decoded_token``."""
    out = []
    texts = outputs.texts
    for c in sorted(choices, key=lambda c: c.index):
        logprobs = None
        if texts is not None:
            logprobs, _ = completion_logprobs(texts, c.logprobs, len(c.echo or ""))
            if c.prompt_logprobs is not None and c.echo is not None:
                echoed, _ = prompt_completion_logprobs(
                    texts, c.prompt_token_ids, c.prompt_logprobs, outputs.num_logprobs
                )
                logprobs = joined(echoed, logprobs)
        out.append(
            CompletionResponseChoice(
                index=c.index,
                text=c.text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=c.prompt_logprobs_out(names, outputs),
                prompt_token_ids=c.prompt_token_ids if outputs.token_ids else None,
                token_ids=c.token_ids if outputs.token_ids else None,
            )
        )
    return CompletionResponse(id=request_id, created=created, model=model, choices=out, usage=usage)
