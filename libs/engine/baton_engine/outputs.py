"""What the offline API returns, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> its Logprob (the sampled token and the top N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # With SamplingParams(prompt_logprobs=N): per prompt token, None for the first.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt, as vLLM's."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class PoolingOutput:
    data: torch.Tensor  # the pooler's output: an embedding, or a classifier's probabilities


@dataclass
class PoolingRequestOutput:
    """What ``LLM.encode`` returns per prompt, as vLLM's."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair, as vLLM's."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # both texts', one after the other
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (its logits with ``PoolingParams(activation=False)``)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What ``LLM.classify`` returns per prompt, as vLLM's."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
