"""Parameters of an embedding request, shaped like vLLM's ``PoolingParams``.

An embedding is the model's final hidden state (after the last norm) at the prompt's last
token, L2-normalized unless ``normalize=False``: vLLM's ``LAST`` pooling, its default for
decoder-only models run as embedders (Qwen3-Embedding, e5-mistral and gte-Qwen2 are read this
way). The request computes its prompt like any other (chunked prefill, prefix-cache hits,
preemption) and ends there.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_engine.errors import InvalidRequestError
from baton_engine.sampling_params import check_truncate_prompt_tokens


@dataclass(frozen=True)
class PoolingParams:
    # Keep the first ``dimensions`` values, then normalize (Matryoshka models only, as vLLM).
    dimensions: int | None = None
    # L2-normalize the embedding (None: yes, vLLM's default for embeddings).
    normalize: bool | None = None
    # Keep only the prompt's last N tokens (-1: as many as max_model_len), as vLLM's.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be at least 1, got {self.dimensions}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    @property
    def normalized(self) -> bool:
        return self.normalize is not False
