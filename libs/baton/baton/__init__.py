"""Baton: LLM serving with disaggregated prefill and decode behind an OpenAI-compatible API.

``from baton import LLM, SamplingParams`` gives the offline API. The names are imported lazily so
that services without torch (the gateway) can import ``baton`` too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from baton_engine.beam_search import BeamSearchParams
    from baton_engine.llm import LLM
    from baton_engine.lora import LoRARequest
    from baton_engine.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        PoolingOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from baton_engine.pooling_params import PoolingParams
    from baton_engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
]


_OUTPUTS = (
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
)


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from baton_engine.llm import LLM

        return LLM
    if name in _OUTPUTS:
        from baton_engine import outputs

        return getattr(outputs, name)
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from baton_engine import sampling_params

        return getattr(sampling_params, name)
    if name == "BeamSearchParams":
        from baton_engine.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "PoolingParams":
        from baton_engine.pooling_params import PoolingParams

        return PoolingParams
    if name == "LoRARequest":
        from baton_engine.lora import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'baton' has no attribute {name!r}")
