"""vLLM's score and rerank APIs (``/score``, ``/v1/score``; ``/rerank``, ``/v1/rerank``,
``/v2/rerank``, Jina's and Cohere's shape), served by embedding models' rule: a pair's score is
the cosine similarity of the two texts' embeddings (``embeddings.py``; one ``Embed`` call for
every distinct text of the request).

Score pairs ``text_1`` with ``text_2`` one to one, one to many or many to many (lists of one
length); rerank scores each document against the query and returns them best first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from baton_gateway.embeddings import PoolingOptions
from baton_gateway.protocol import OpenAIBaseModel, UsageInfo

TextOrTexts = str | list[str]


class ScoreRequest(PoolingOptions):
    text_1: TextOrTexts
    text_2: TextOrTexts


class RerankRequest(PoolingOptions):
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def score_response(
    req_id: str, model: str, scores: Sequence[float], num_tokens: int
) -> ScoreResponse:
    return ScoreResponse(
        id=req_id,
        model=model,
        data=[ScoreData(index=i, score=score) for i, score in enumerate(scores)],
        usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )


def rerank_response(
    req_id: str, model: str, request: RerankRequest, scores: Sequence[float], num_tokens: int
) -> RerankResponse:
    """The documents best first (ties in their order), the first ``top_n`` (0: all)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if request.top_n:
        order = order[: request.top_n]
    results = [
        RerankResult(
            index=i,
            document=RerankDocument(text=request.documents[i])
            if request.return_documents
            else None,
            relevance_score=scores[i],
        )
        for i in order
    ]
    return RerankResponse(
        id=req_id, model=model, usage=RerankUsage(total_tokens=num_tokens), results=results
    )
