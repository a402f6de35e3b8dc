"""``POST /v1/embeddings``: OpenAI's embeddings API with vLLM's extras.

``input`` is a text, a list of texts, a list of token ids or a list of such lists (OpenAI's
forms); with ``messages`` instead, the conversation is rendered with the chat template first
(vLLM's chat embeddings). Every input's ids go to one decode worker in one ``Embed`` call; each
embedding is the model's final hidden state at the input's last token, L2-normalized
(``baton_engine.pooling_params``). ``encoding_format="base64"`` (what the OpenAI SDK asks for by
default) sends each embedding as its little-endian float32 bytes in base64.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field, model_validator

from baton_gateway.protocol import (
    ChatPrompt,
    OpenAIBaseModel,
    PromptInput,
    UsageInfo,
    check_prompt,
)

if TYPE_CHECKING:
    from baton_gateway.codec import Embedded


class PoolingOptions(OpenAIBaseModel):
    """What every request served by embeddings takes besides its inputs (``/v1/embeddings``,
    and the score and rerank APIs of ``scoring.py``): vLLM's fields."""

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    request_id: str | None = Field(default=None, min_length=1)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)

    @model_validator(mode="after")
    def _check_truncation(self) -> PoolingOptions:
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1, or -1")
        return self


class _EmbeddingOptions(PoolingOptions):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, lt=2**31)
    user: str | None = None
    normalize: bool | None = None  # L2-normalize (None: yes; vLLM's)


class EmbeddingCompletionRequest(_EmbeddingOptions):
    input: PromptInput
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_input(self) -> EmbeddingCompletionRequest:
        check_prompt(self.input)
        return self


class EmbeddingChatRequest(_EmbeddingOptions, ChatPrompt):
    add_generation_prompt: bool = False  # (vLLM's default for embeddings)


EmbeddingRequest = EmbeddingCompletionRequest | EmbeddingChatRequest


def embedding_request(body: Any) -> EmbeddingRequest:
    """A ``/v1/embeddings`` body: a conversation when it has ``messages``, else inputs (as in
    vLLM). Raises pydantic's ValidationError."""
    if isinstance(body, dict) and "messages" in body:
        return EmbeddingChatRequest.model_validate(body)
    return EmbeddingCompletionRequest.model_validate(body)


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


def response(
    req_id: str, model: str, embedded: Sequence[Embedded], encoding_format: str
) -> EmbeddingResponse:
    """The response to a request whose inputs were embedded as ``embedded`` (in order)."""
    num_prompt_tokens = sum(e.num_prompt_tokens for e in embedded)
    return EmbeddingResponse(
        id=req_id,
        model=model,
        data=[
            EmbeddingData(index=i, embedding=encode(e.values, encoding_format))
            for i, e in enumerate(embedded)
        ],
        usage=UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens),
    )


class PoolingData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: UsageInfo


def pooling_response(
    req_id: str, model: str, pooled: Sequence[Embedded], encoding_format: str
) -> PoolingResponse:
    """vLLM's ``/pooling`` answer: each input's pooler output as it is (an embedding model's
    embedding, a classifier's labels' probabilities), in order."""
    num_prompt_tokens = sum(e.num_prompt_tokens for e in pooled)
    return PoolingResponse(
        id=req_id,
        model=model,
        data=[
            PoolingData(index=i, data=encode(e.values, encoding_format))
            for i, e in enumerate(pooled)
        ],
        usage=UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens),
    )


def encode(values: list[float], encoding_format: str) -> list[float] | str:
    """One embedding as the response carries it: floats, or base64 of little-endian float32
    (what OpenAI's clients decode with ``np.frombuffer(..., dtype="float32")``)."""
    if encoding_format == "float":
        return values
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
