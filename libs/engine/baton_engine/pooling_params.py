"""Parameters of an embedding request, shaped like vLLM's ``PoolingParams``, and the engine's
pooler (``PoolerConfig``, vLLM's ``--pooler-config``).

An embedding is the model's final hidden states (after the last norm) pooled over the prompt,
L2-normalized unless ``normalize=False``. ``LAST`` (the hidden state at the prompt's last token)
is vLLM's default for decoder-only models run as embedders (Qwen3-Embedding, e5-mistral and
gte-Qwen2 are read this way); ``MEAN`` averages every prompt token's, ``CLS`` takes the first
token's. A model folder's sentence-transformers ``Pooling`` module (``modules.json``) picks the
pooling, as in vLLM, unless ``--pooler-config`` names one. The request computes its prompt
like any other (chunked prefill, preemption; prefix-cache hits only with ``LAST``, as the
other poolings read every prompt token's hidden state) and ends there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from baton_engine.errors import InvalidRequestError
from baton_engine.sampling_params import check_truncate_prompt_tokens


@dataclass(frozen=True)
class PoolingParams:
    # Keep the first ``dimensions`` values, then normalize (Matryoshka models only, as vLLM).
    dimensions: int | None = None
    # L2-normalize the embedding (None: as the pooler says; yes by default, as vLLM).
    normalize: bool | None = None
    # A classifier's outputs as probabilities (softmax over its labels; sigmoid with one
    # label), else its raw logits; None: yes (vLLM's). Classifiers only.
    activation: bool | None = None
    # Keep only the prompt's last N tokens (-1: as many as max_model_len), as vLLM's.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be at least 1, got {self.dimensions}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)


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


def pair_token_ids(tokenizer: Any, first: str, second: str) -> list[int]:
    """A cross-encoder's input for a pair, as vLLM builds it: the tokenizer's encoding of the
    two texts as a pair (with the special tokens its template puts around and between them;
    a decoder's tokenizer usually just joins them)."""
    return list(tokenizer(first, second, add_special_tokens=True)["input_ids"])


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """What an embedding model's score is (vLLM's rule): the embeddings' cosine similarity."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y / norms) if norms > 0 else 0.0


POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling module config -> vLLM's pooling type
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


@dataclass(frozen=True)
class PoolerConfig:
    """How the engine pools an embedding (vLLM's ``PoolerConfig``): ``pooling_type`` (one of
    ``POOLING_TYPES``) and whether requests that do not say are L2-normalized. A classifier's
    pooled hidden state goes through its head instead: ``activation`` is what turns the
    head's logits into probabilities ("softmax", or "sigmoid" for one label), None for an
    embedding model."""

    pooling_type: str = "LAST"
    normalize: bool = True
    activation: str | None = None

    @property
    def classifies(self) -> bool:
        return self.activation is not None

    @property
    def every_token(self) -> bool:
        """Whether the pooling reads every prompt token's hidden state (not the last alone)."""
        return self.pooling_type != "LAST"

    @classmethod
    def resolve(
        cls, pooler_config: str | None, model_dir: Path | None, num_labels: int = 0
    ) -> PoolerConfig:
        """``pooler_config`` (vLLM's ``--pooler-config`` JSON, e.g. ``{"pooling_type":
        "MEAN"}``) over the model folder's sentence-transformers ``Pooling`` module over
        ``LAST``; ``num_labels``: a classifier's (0: an embedding model).
        ``InvalidRequestError`` says what is wrong with either."""
        found = _sentence_transformers_pooling(model_dir) if model_dir is not None else {}
        given: Any = {}
        if pooler_config:
            try:
                given = json.loads(pooler_config)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"--pooler-config is not JSON: {e}") from None
            if not isinstance(given, dict):
                raise InvalidRequestError("--pooler-config must be a JSON object")
            unknown = sorted(set(given) - {"pooling_type", "normalize"})
            if unknown:
                raise InvalidRequestError(
                    f"--pooler-config: {', '.join(unknown)} not supported "
                    "(supported: pooling_type, normalize)"
                )
        merged = {**found, **given}
        pooling_type = str(merged.get("pooling_type", "LAST")).upper()
        if pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling_type {merged['pooling_type']!r} is not supported "
                f"(supported: {', '.join(POOLING_TYPES)})"
            )
        normalize = merged.get("normalize", True)
        if not isinstance(normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {normalize!r}")
        activation = None if not num_labels else "sigmoid" if num_labels == 1 else "softmax"
        return cls(pooling_type, normalize, activation)


def _sentence_transformers_pooling(model_dir: Path) -> dict[str, Any]:
    """The pooling of the folder's sentence-transformers ``Pooling`` module, if it has one:
    ``{"pooling_type": ...}``."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return {}
    for module in modules if isinstance(modules, list) else []:
        if not isinstance(module, dict) or not str(module.get("type", "")).endswith(
            "models.Pooling"
        ):
            continue
        config_path = model_dir / str(module.get("path", "")) / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as e:
            raise InvalidRequestError(f"cannot read {config_path}: {e}") from None
        modes = [key for key, on in config.items() if key.startswith("pooling_mode") and on]
        if len(modes) != 1 or modes[0] not in _ST_MODES:
            raise InvalidRequestError(
                f"{config_path}: pooling {', '.join(modes) or 'none'} is not supported "
                f"(one of {', '.join(_ST_MODES)}; or pass --pooler-config)"
            )
        return {"pooling_type": _ST_MODES[modes[0]]}
    return {}
