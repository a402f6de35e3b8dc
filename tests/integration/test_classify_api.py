"""Sequence-classification models on ``baton serve``: vLLM's ``/classify`` (labels and their
probabilities) and, for a cross-encoder (one label), ``/score`` and ``/rerank`` reading each
pair as one input; answers equal the offline engine's (``LLM.classify`` / ``LLM.score``), and
what such a model does not serve is a clear 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from tiny_models import build_classifier

pytestmark = pytest.mark.integration

LABELS = ["negative", "neutral", "positive"]
TEXTS = ["The film was wonderful.", "A tokenizer splits text into tokens.", "hello"]
QUERY = "Where is Paris?"
DOCUMENTS = ["Paris is in France.", "Bananas are yellow.", "The Seine flows through Paris."]


def _served(
    serve_launcher: Any, folder: Path, family: str, labels: list[str], tokenizer_dir: Path
) -> Iterator[tuple[httpx.Client, Any]]:
    """A tiny classifier with ``labels`` served by ``baton serve`` (aggregated: one decode
    worker computes every input), and the offline engine on it."""
    from baton import LLM

    build_classifier(family, labels, tokenizer_dir, folder)
    offline = LLM(str(folder), dtype="float32", max_model_len=512, kv_cache_memory=32 << 20)
    server = serve_launcher.start([str(folder), "--dtype", "float32", "--mode", "aggregated"])
    try:
        with httpx.Client(base_url=server.root_url, timeout=60) as http:
            yield http, offline
    finally:
        _, survivors = serve_launcher.stop(server)
        assert not survivors, f"left behind: {survivors}"


@pytest.fixture(scope="module")
def classifier(
    serve_launcher: Any, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[httpx.Client, Any]]:
    folder = tmp_path_factory.mktemp("classifier")
    yield from _served(serve_launcher, folder, "qwen2", LABELS, default_model_dir)


@pytest.fixture(scope="module")
def reranker(
    serve_launcher: Any, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[httpx.Client, Any]]:
    folder = tmp_path_factory.mktemp("reranker")
    yield from _served(serve_launcher, folder, "llama", ["relevance"], default_model_dir)


def close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4)


def test_classify_equals_the_offline_engine(classifier: tuple[httpx.Client, Any]) -> None:
    http, offline = classifier
    want = [o.outputs.probs for o in offline.classify(TEXTS, use_tqdm=False)]
    for path in ("/classify", "/v1/classify"):
        reply = http.post(path, json={"input": TEXTS})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["id"].startswith("classify-") and body["object"] == "list"
        for i, (data, probs) in enumerate(zip(body["data"], want, strict=True)):
            assert data["index"] == i and data["num_classes"] == 3
            close(data["probs"], probs)
            assert data["label"] == LABELS[int(np.argmax(probs))]
        counts = [http.post("/tokenize", json={"prompt": t}).json()["count"] for t in TEXTS]
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(counts)
    assert len({d["label"] for d in body["data"]}) > 1  # (the labels differ: argmax is read)
    # vLLM's /pooling: each input's pooler output, here the labels' probabilities
    pooled = http.post("/pooling", json={"input": TEXTS, "encoding_format": "float"}).json()
    for data, probs in zip(pooled["data"], want, strict=True):
        assert data["object"] == "pooling"
        close(data["data"], probs)

    # One text; token ids; the head's logits; truncation to the last tokens.
    ids = http.post("/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    (by_ids,) = http.post("/classify", json={"input": ids}).json()["data"]
    close(by_ids["probs"], want[1])
    (single,) = http.post("/classify", json={"input": TEXTS[2]}).json()["data"]
    close(single["probs"], want[2])
    from baton import PoolingParams

    (raw,) = offline.classify(
        TEXTS[0], pooling_params=PoolingParams(activation=False), use_tqdm=False
    )
    logits = http.post("/classify", json={"input": TEXTS[0], "activation": False}).json()
    close(logits["data"][0]["probs"], raw.outputs.probs)
    # A conversation, rendered as /tokenize renders it (no generation prompt, as vLLM).
    messages = [{"role": "user", "content": TEXTS[0]}]
    rendered = http.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()["tokens"]
    (as_chat,) = offline.classify({"prompt_token_ids": rendered}, use_tqdm=False)
    (by_chat,) = http.post("/classify", json={"messages": messages}).json()["data"]
    close(by_chat["probs"], as_chat.outputs.probs)
    (tail,) = offline.classify({"prompt_token_ids": ids[-3:]}, use_tqdm=False)
    cut = http.post("/classify", json={"input": TEXTS[1], "truncate_prompt_tokens": 3}).json()
    assert cut["usage"]["prompt_tokens"] == 3
    close(cut["data"][0]["probs"], tail.outputs.probs)


def test_what_a_classifier_does_not_serve(classifier: tuple[httpx.Client, Any]) -> None:
    http, _ = classifier
    for path, body, message in [
        ("/v1/embeddings", {"input": "hi"}, "does not embed"),
        ("/score", {"text_1": "a", "text_2": "b"}, "3 labels: use /classify"),
        ("/rerank", {"query": "a", "documents": ["b"]}, "3 labels: use /classify"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "does not generate"),
        ("/classify", {"input": []}, "empty"),
        ("/classify", {"input": "hi", "model": "nope"}, "does not exist"),
    ]:
        reply = http.post(path, json=body)
        assert reply.status_code in (400, 404), (path, reply.text)
        assert message in reply.json()["error"]["message"], (path, reply.text)
    # and it serves on
    assert http.post("/classify", json={"input": "hi"}).status_code == 200


def test_a_cross_encoder_scores_and_reranks_pairs(reranker: tuple[httpx.Client, Any]) -> None:
    http, offline = reranker
    want = [s.outputs.score for s in offline.score(QUERY, DOCUMENTS, use_tqdm=False)]
    pair_tokens = [s.prompt_token_ids for s in offline.score(QUERY, DOCUMENTS, use_tqdm=False)]
    reply = http.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    close([d["score"] for d in body["data"]], want)
    assert body["usage"]["prompt_tokens"] == sum(len(t) for t in pair_tokens)
    by_position = http.post("/v1/score", json={"text_1": [QUERY] * 2, "text_2": DOCUMENTS[:2]})
    close([d["score"] for d in by_position.json()["data"]], want[:2])

    reply = http.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    best_first = sorted(range(3), key=lambda i: -want[i])
    assert [r["index"] for r in results] == best_first[:2]
    for r in results:
        assert r["document"]["text"] == DOCUMENTS[r["index"]]
        close(r["relevance_score"], want[r["index"]])
    (one,) = http.post("/classify", json={"input": QUERY}).json()["data"]
    assert one["label"] == "relevance" and one["num_classes"] == 1
