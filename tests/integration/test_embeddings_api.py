"""``POST /v1/embeddings`` on ``baton serve``, driven by the official ``openai`` SDK (which asks
for base64 and decodes it) and by plain HTTP: the served embeddings are the offline engine's
(``LLM.embed``), in every input form, with OpenAI's response shape and usage."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hello"]


@pytest.fixture(scope="module")
def offline(default_model_dir: Path) -> list[list[float]]:
    """The offline engine's embeddings of TEXTS."""
    from baton import LLM

    llm = LLM(str(default_model_dir), max_model_len=512, kv_cache_memory=32 << 20)
    return [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]


def close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=1e-3)


def test_sdk_embeddings_equal_the_offline_engine(
    client: OpenAI, http: httpx.Client, offline: list[list[float]]
) -> None:
    response = client.embeddings.create(model=MODEL, input=TEXTS)  # (base64 on the wire)
    assert response.object == "list" and response.model == MODEL
    assert [d.index for d in response.data] == [0, 1, 2]
    for data, want in zip(response.data, offline, strict=True):
        assert data.object == "embedding" and len(data.embedding) == 576
        close(data.embedding, want)
    counts = [http.post("/tokenize", json={"prompt": t}).json()["count"] for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(counts)

    floats = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float"})
    assert floats.status_code == 200, floats.text
    body = floats.json()
    assert body["id"].startswith("embd-") and body["usage"]["prompt_tokens"] == counts[0]
    close(body["data"][0]["embedding"], offline[0])
    b64 = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    raw = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), dtype="<f4")
    close(raw, body["data"][0]["embedding"])
    # vLLM's /pooling: the same request, each input's pooler output (here the embedding)
    pooled = http.post("/pooling", json={"input": TEXTS, "encoding_format": "float"})
    assert pooled.status_code == 200, pooled.text
    answer = pooled.json()
    assert answer["id"].startswith("pool-") and answer["usage"]["prompt_tokens"] == sum(counts)
    for i, (data, want) in enumerate(zip(answer["data"], offline, strict=True)):
        assert data["index"] == i and data["object"] == "pooling"
        close(data["data"], want)


def test_input_forms(client: OpenAI, http: httpx.Client, offline: list[list[float]]) -> None:
    """Token ids, one or many, embed as the text they encode; a conversation as its
    rendered prompt (no generation prompt, as vLLM); truncation keeps the last tokens."""
    ids = [http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    one = client.embeddings.create(model=MODEL, input=ids[0])
    close(one.data[0].embedding, offline[0])
    many = client.embeddings.create(model=MODEL, input=ids)
    for data, want in zip(many.data, offline, strict=True):
        close(data.embedding, want)
    (single,) = client.embeddings.create(model=MODEL, input=TEXTS[2]).data
    close(single.embedding, offline[2])

    messages = [{"role": "user", "content": "Describe Paris."}]
    chat = http.post("/v1/embeddings", json={"messages": messages, "encoding_format": "float"})
    assert chat.status_code == 200, chat.text
    rendered = http.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    as_ids = client.embeddings.create(model=MODEL, input=rendered["tokens"])
    assert chat.json()["usage"]["prompt_tokens"] == rendered["count"]
    close(chat.json()["data"][0]["embedding"], as_ids.data[0].embedding)

    cut = client.embeddings.create(
        model=MODEL, input=TEXTS[0], extra_body={"truncate_prompt_tokens": 3}
    )
    tail = client.embeddings.create(model=MODEL, input=ids[0][-3:])
    assert cut.usage.prompt_tokens == 3
    close(cut.data[0].embedding, tail.data[0].embedding)
    raw = client.embeddings.create(model=MODEL, input=TEXTS[0], extra_body={"normalize": False})
    norm = float(np.linalg.norm(raw.data[0].embedding))
    assert norm > 1.5
    close(np.asarray(raw.data[0].embedding) / norm, offline[0])


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input": "word " * 600}, 400, "maximum context length is 512 tokens"),
        ({"input": []}, 400, "must not be empty"),
        ({"input": [[1, 2], []]}, 400, "must not be empty"),
        ({"input": [1, 10**7]}, 400, "out of vocabulary"),
        ({"input": "hi", "dimensions": 32}, 400, "Matryoshka"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "hi", "model": "no-such-model"}, 404, "does not exist"),
        ({"messages": []}, 400, "messages"),
    ],
)
def test_bad_requests(http: httpx.Client, body: dict[str, Any], status: int, message: str) -> None:
    reply = http.post("/v1/embeddings", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["code"] == status


def test_sdk_raises_for_a_refusal(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model=MODEL, input="hi", dimensions=16)
    # and the server serves on
    assert len(client.embeddings.create(model=MODEL, input="hi").data[0].embedding) == 576


def _cos(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_score_and_rerank(http: httpx.Client, offline: list[list[float]]) -> None:
    """vLLM's score and rerank APIs, as embedding models answer them: each pair's cosine
    similarity of the offline engine's embeddings; rerank best first."""
    one_to_many = http.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert one_to_many.status_code == 200, one_to_many.text
    body = one_to_many.json()
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert [d["index"] for d in body["data"]] == [0, 1]
    for d, other in zip(body["data"], offline[1:], strict=True):
        assert abs(d["score"] - _cos(offline[0], other)) < 1e-3
    counts = [http.post("/tokenize", json={"prompt": t}).json()["count"] for t in TEXTS]
    assert body["usage"]["prompt_tokens"] == 2 * counts[0] + counts[1] + counts[2]
    by_position = http.post(
        "/v1/score", json={"text_1": [TEXTS[0], TEXTS[1]], "text_2": [TEXTS[2], TEXTS[0]]}
    ).json()
    want = [_cos(offline[0], offline[2]), _cos(offline[1], offline[0])]
    assert [round(d["score"], 3) for d in by_position["data"]] == [round(w, 3) for w in want]

    documents = [TEXTS[2], TEXTS[0], TEXTS[1]]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        reply = http.post(path, json={"query": TEXTS[0], "documents": documents, "top_n": 2})
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert len(results) == 2 and results[0]["index"] == 1  # the query itself, first
        assert results[0]["document"]["text"] == TEXTS[0]
        assert abs(results[0]["relevance_score"] - 1.0) < 1e-3
        scores = [_cos(offline[0], offline[i]) for i in (2, 0, 1)]
        assert results[1]["index"] == max((2, 0), key=lambda i: scores[i])
    everything = http.post("/rerank", json={"query": "hi", "documents": documents}).json()
    relevance = [r["relevance_score"] for r in everything["results"]]
    assert len(relevance) == 3 and relevance == sorted(relevance, reverse=True)

    for path, body_, message in [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "pair by position"),
        ("/score", {"text_1": [], "text_2": "c"}, "at least one text"),
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/score", {"text_1": "a", "text_2": "b", "model": "nope"}, "does not exist"),
    ]:
        reply = http.post(path, json=body_)
        assert reply.status_code in (400, 404), reply.text
        assert message in reply.json()["error"]["message"]
