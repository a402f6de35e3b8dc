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
