"""Parameters of an embedding request, shaped like vLLM's ``PoolingParams``.

An embedding is the model's final hidden state (after the last norm) at the prompt's last
token, L2-normalized unless ``normalize=False``: vLLM's ``LAST`` pooling, its default for
decoder-only models run as embedders (Qwen3-Embedding, e5-mistral and gte-Qwen2 are read this
way). The request computes its prompt like any other (chunked prefill, prefix-cache hits,
preemption) and ends there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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


def score_pairs(first: str | Sequence[str], second: str | Sequence[str]) -> list[tuple[str, str]]:
    """The pairs vLLM's score API scores, in order: one text against each of the other side's,
    or lists of one length pair by position. Raises ``InvalidRequestError`` otherwise."""
    a = [first] if isinstance(first, str) else list(first)
    b = [second] if isinstance(second, str) else list(second)
    if not a or not b:
        raise InvalidRequestError("both sides of a score need at least one text")
    if len(a) == 1:
        return [(a[0], t) for t in b]
    if len(b) == 1:
        return [(t, b[0]) for t in a]
    if len(a) != len(b):
        raise InvalidRequestError(
            f"texts to score pair by position: got {len(a)} and {len(b)} (one side may also be "
            "a single text)"
        )
    return list(zip(a, b, strict=True))


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """What an embedding model's score is (vLLM's rule): the embeddings' cosine similarity."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y / norms) if norms > 0 else 0.0
