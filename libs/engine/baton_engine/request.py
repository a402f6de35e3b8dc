"""The engine's view of one request: tokens, progress and state. Never leaves the engine core."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from baton_engine.core.outputs import TokenLogprobs
from baton_engine.pooling_params import PoolingParams
from baton_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from baton_engine.structured_output import Grammar


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # blocks allocated, the prompt's KV being pulled
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()
    FINISHED_PREFILLED = enum.auto()  # prefill-only: first token sampled, prompt KV held

    @property
    def is_finished(self) -> bool:
        return self._value_ >= _FIRST_FINISHED  # an int compare: runs per request per step

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED._value_  # every later member is finished too
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_PREFILLED: "prefilled",  # not an end: decoding continues elsewhere
}


@dataclass
class Request:
    """One sequence being generated.

    ``num_computed_tokens`` catches up to ``num_tokens`` (prompt + output). Prefill, chunked
    prefill, prefix-cache hits and recompute after preemption all move that one counter.

        |<----------- prompt ----------->|<---- output ---->|
        |<-- cached -->|<-- computed -->|<-- to compute -->|
                                                   num_tokens ^
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16  # resolved against max_model_len at admission
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower is served first (scheduling_policy "priority"); ties by arrival
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled by steps already launched but not yet reported (async scheduling: the next
    # step is scheduled before the previous one's tokens reach the host). Scheduling counts
    # them as if known; ``update_from_output`` turns each into a real token.
    num_pending_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Disaggregation. A prefill-only request ends after its first token with its prompt's blocks
    # held (FINISHED_PREFILLED). A request with ``remote_kv`` (opaque to the engine: where the
    # prompt's KV lives) first waits for those blocks to be pulled instead of computing them.
    prefill_only: bool = False
    remote_kv: object | None = None
    # Once its pull succeeded: the first position whose KV came from another worker (a draft
    # model's KV of those tokens is computed here: the pull brings the model's only).
    remote_kv_from: int | None = None
    # An embedding request: it ends when its prompt is computed (max_tokens 1; the token the
    # step samples is dropped above the core), reporting the pooled hidden state.
    pooling: PoolingParams | None = None
    # The LoRA adapter it runs with (None: the base model), by name: its KV is hashed from the
    # adapter's root (``hashing.prefix_root``) and a step runs at most ``max_loras`` adapters.
    lora_name: str | None = None
    # vLLM's cache_salt: its KV is hashed from a root of the salt too, so it shares prefix-cache
    # blocks only with requests of the same salt.
    cache_salt: str | None = None
    # Structured output: the request's matcher, which accepts each token it samples (the
    # scheduler's update) and bounds the next (the engine's bitmask); the request ends when
    # the grammar does.
    grammar: Grammar | None = None
    # vLLM's prompt embeddings ([prompt length, hidden], the model's dtype, on the host): the
    # prompt's inputs instead of its tokens' embeddings. Its ``prompt_token_ids`` are then ids
    # of the rows (``prompt_embeds.row_ids``: negative, never a token) that its blocks are
    # hashed from; it speculates no drafts and has no prompt logprobs.
    prompt_embeds: torch.Tensor | None = None
    # prompt_logprobs[i] is prompt token i + 1's (filled chunk by chunk, sent with token 1)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Set by the KV cache manager: a step whose computed tokens end at or below this needs no
    # new block and fills no block to index, so the scheduler need not call ``allocate_slots``
    # (most decode steps). 0 while the request holds no blocks.
    kv_limit: int = 0
    # For the scheduler's common case, set once: while fewer than ``stop_len`` tokens are out
    # and the last is not in ``stop_ids``, ``check_stop`` returns None and the step's output is
    # the token alone (``stop_len`` is 0 when a request must take the full path: prefill-only,
    # embedding, logprobs or prompt logprobs asked for).
    stop_len: int = field(init=False, repr=False)
    stop_ids: frozenset[int] = field(init=False, repr=False)
    # Multi-step scheduling may run its decodes several passes a step: its sampling needs none
    # of its tokens on the host (no penalties or bad words; ``min_tokens`` is checked when
    # scheduling), it reports no logprobs, and no grammar. Its stop strings are matched token
    # by token above the engine (the gateway, ``LLM``), which ends the output at the token that
    # completes one and aborts it, as with speculative decoding's several tokens a step.
    multi_step: bool = field(init=False, repr=False)
    # Speculative decoding may schedule drafts after its last token, several tokens coming out
    # of one step: no prompt logprobs (its logprobs, penalties, bad words and grammar's masks are
    # each draft's row's; its stop strings are matched token by token above the engine, which
    # ends it). A seeded request's draws are seeded by its tokens' indices: drafts leave its
    # tokens as they are.
    speculative: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        sp = self.sampling_params
        plain = (
            not self.prefill_only
            and self.pooling is None
            and sp.logprobs is None
            and sp.prompt_logprobs is None
            and self.grammar is None
        )
        self.stop_len = self.max_tokens if plain else 0
        eos = () if sp.ignore_eos else self.eos_token_ids
        self.stop_ids = frozenset((*eos, *sp.stop_token_ids))
        self.multi_step = (
            plain
            and self.prompt_embeds is None  # (a pass's input is its last token's embedding)
            and sp.presence_penalty == 0.0
            and sp.frequency_penalty == 0.0
            and sp.repetition_penalty == 1.0
            and not sp.bad_words_token_ids
        )
        self.speculative = (
            not self.prefill_only
            and self.pooling is None
            and sp.prompt_logprobs is None
            and self.prompt_embeds is None
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last sampled token causes, or None to keep going."""
        sp = self.sampling_params
        out = self.output_token_ids
        if self.grammar is not None and self.grammar.is_ended and out:
            self.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if (  # the common case, first: nothing can stop it (one test of each cause)
            out
            and len(out) < self.max_tokens
            and not self.prefill_only
            and (sp.ignore_eos or out[-1] not in self.eos_token_ids)
            and out[-1] not in sp.stop_token_ids
        ):
            return None
        if self.output_token_ids:
            last = self.output_token_ids[-1]
            if self.num_output_tokens >= sp.min_tokens:
                if not sp.ignore_eos and last in self.eos_token_ids:
                    self.stop_reason = None
                    return RequestStatus.FINISHED_STOPPED
                if last in sp.stop_token_ids:
                    self.stop_reason = last
                    return RequestStatus.FINISHED_STOPPED
        if self.pooling is not None:  # its prompt is computed: done (as vLLM's, "stop")
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.prefill_only and self.output_token_ids:
            return RequestStatus.FINISHED_PREFILLED
        return None
