"""The narrow types that cross between scheduler, model runner and engine core."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from baton_engine.pooling_params import PoolingParams
from baton_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from baton_engine.kv_cache.host_cache import KVCopy


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption): its full data."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # before this step (prefix-cache hits included)
    pooling: PoolingParams | None = None  # an embedding request (its token is not kept)
    lora_name: str | None = None  # its LoRA adapter (None: the base model)
    # the first position whose KV was pulled from another worker (Request.remote_kv_from)
    remote_kv_from: int | None = None
    prompt_embeds: torch.Tensor | None = None  # Request.prompt_embeds (on the host)


class CachedRequestData(NamedTuple):
    """A request the runner already holds: only what changed (a NamedTuple: built per request
    per step)."""

    req_id: str
    new_block_ids: list[int]  # appended to its block table this step
    num_computed_tokens: int  # before this step


@dataclass(frozen=True)
class SchedulerOutput:
    step_id: int  # numbers the scheduler's steps; its output is reported with it
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: Mapping[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    finished_req_ids: frozenset[str]  # finished or aborted since the last step: drop their state
    preempted_req_ids: frozenset[str]  # preempted this step: drop their state
    # Multi-step scheduling: the step runs this many forward passes of the same decodes (one
    # token each per pass, ``num_scheduled_tokens`` counts one pass), each pass's input the
    # token the one before sampled (see ``Scheduler.schedule``).
    num_steps: int = 1
    # Speculative decoding: req_id -> the draft tokens scheduled after its last token (its
    # ``num_scheduled_tokens`` counts them); the runner checks them (spec_decode)
    spec_token_ids: Mapping[str, list[int]] = field(default_factory=dict)
    # The host KV tier (--kv-offloading-size): blocks to move between the pool and the tier
    # before this step's forward pass, in this order (kv_cache.host_cache)
    kv_copies: Sequence[KVCopy] = ()

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class GrammarBitmask(NamedTuple):
    """The tokens that requests with structured output may sample next, for one step: row
    ``rows[req_id]`` of ``bitmask`` (``[N, ceil(vocab / 32)]`` int32 on the host, bit ``t`` of a
    row set when token ``t`` is allowed)."""

    rows: Mapping[str, int]
    bitmask: torch.Tensor


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs for one sampled token: the sampled one first, then the top N."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the sampled token in the full distribution (1 = most likely)


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled_token_ids: Mapping[str, int]  # req_id -> token; only requests that sampled this step
    logprobs: Mapping[str, TokenLogprobs] = field(default_factory=dict)  # req_id -> its logprobs
    # req_id -> (index of the first prompt token covered, logprobs of consecutive prompt tokens)
    prompt_logprobs: Mapping[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # A multi-step's tokens instead of ``sampled_token_ids``: req_id -> one token per pass
    step_token_ids: Mapping[str, list[int]] = field(default_factory=dict)
    # Embedding requests whose prompt ended this step: req_id -> the pooled hidden state
    pooled: Mapping[str, list[float]] = field(default_factory=dict)
    # Requests that had drafts (SchedulerOutput.spec_token_ids), instead of
    # ``sampled_token_ids``: req_id -> the drafts it kept, then the token sampled after them
    spec_token_ids: Mapping[str, list[int]] = field(default_factory=dict)
    # and of those that asked for logprobs: req_id -> the logprobs of each of those tokens
    spec_logprobs: Mapping[str, list[TokenLogprobs]] = field(default_factory=dict)
    # A draft model's drafts for the next step (runner.draft): req_id -> its tokens after the
    # request's known ones
    draft_token_ids: Mapping[str, list[int]] = field(default_factory=dict)


class EngineCoreOutput(NamedTuple):
    """What one step produced for one request (a NamedTuple: built per request per step)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefilled" | None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # "prefilled" only: the blocks holding the prompt's KV, in order, until ``release_held``.
    kv_block_ids: list[int] | None = None
    # With the first sampled token: prompt tokens 1.. (token 0 has none), when asked for.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # An embedding request's (PoolingParams) one output: the pooled hidden state (and no
    # token).
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class KVLoad:
    """Blocks a request waits for: the prompt blocks from ``first_block`` on (the ones before
    are cached locally) must be filled from ``remote`` into ``local_block_ids``, then reported
    with ``EngineCore.finish_kv_load``."""

    req_id: str
    remote: object  # what the request was added with (the KV handle)
    first_block: int
    local_block_ids: list[int]
