"""Sequence-classification models offline (``LLM.classify``; ``LLM.score`` with a
cross-encoder), as vLLM serves them: the model's head on the final hidden state at the
prompt's last token, softmax over its labels (sigmoid with one label); equal to Hugging Face
transformers' ``*ForSequenceClassification`` however the engine computes the prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build_classifier

from baton import LLM, PoolingParams, SamplingParams
from baton_engine.config import EngineConfig, ModelConfig
from baton_engine.errors import InvalidRequestError
from baton_engine.pooling_params import pair_token_ids

LABELS = ["negative", "neutral", "positive"]
TEXTS = [
    "The film was wonderful.",
    "A tokenizer splits text into tokens; " * 8,  # longer than a step's budget: chunked
    "def add(a, b):\n    return a + b",
]
SMALL: dict[str, Any] = dict(
    dtype="float32", max_model_len=256, max_num_batched_tokens=32, kv_cache_memory=16 << 20
)


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def close(a: list[float], b: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(a), b, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def classifier(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("qwen2-classifier")
    return out, build_classifier("qwen2", LABELS, default_model_dir, out)


def test_classify_matches_transformers(classifier: Any) -> None:
    """Probabilities (and, with ``activation=False``, logits) equal transformers', alone,
    batched, chunked (a step takes 32 tokens) and from the prefix cache; the engine refuses
    what a classifier does not do and serves on."""
    folder, hf = classifier
    assert ModelConfig.from_path(folder).labels == tuple(LABELS)
    llm = LLM(str(folder), **SMALL)
    tok = llm.get_tokenizer()
    outs = llm.classify(TEXTS, use_tqdm=False)
    for out, text in zip(outs, TEXTS, strict=True):
        ids = tok(text).input_ids
        assert 0 not in ids  # (transformers would read id 0 as padding)
        assert out.prompt_token_ids == ids and out.outputs.num_classes == 3
        close(out.outputs.probs, hf_logits(hf, ids).softmax(0))
    assert len(outs[1].prompt_token_ids) > 32  # it took several steps
    again = llm.classify(TEXTS, use_tqdm=False)  # every prompt's blocks are cached now
    assert again[1].num_cached_tokens > 0
    for got, want in zip(again, outs, strict=True):
        close(got.outputs.probs, torch.tensor(want.outputs.probs))
    (raw,) = llm.classify(TEXTS[0], pooling_params=PoolingParams(activation=False), use_tqdm=False)
    close(raw.outputs.probs, hf_logits(hf, tok(TEXTS[0]).input_ids))

    with pytest.raises(InvalidRequestError, match="does not generate"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="use classify"):
        llm.embed("hi", use_tqdm=False)
    for params in (PoolingParams(dimensions=2), PoolingParams(normalize=False)):
        with pytest.raises(InvalidRequestError, match="do not apply"):
            llm.classify("hi", pooling_params=params, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="3 labels: use classify"):
        llm.score("a", "b", use_tqdm=False)
    assert llm.classify("hi", use_tqdm=False)[0].outputs.num_classes == 3


def test_cross_encoder_scores_each_pair_as_one_input(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """A one-label classifier (a reranker) scores a pair by reading both texts as one input
    (the tokenizer's pair encoding) and taking its head's sigmoid, as vLLM's score API."""
    hf = build_classifier("llama", ["relevance"], default_model_dir, tmp_path)
    llm = LLM(str(tmp_path), **SMALL)
    tok = llm.get_tokenizer()
    query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "Hi"]
    scores = llm.score(query, docs, use_tqdm=False)
    for got, doc in zip(scores, docs, strict=True):
        ids = pair_token_ids(tok, query, doc)
        assert ids == tok(query, doc).input_ids and got.prompt_token_ids == ids
        want = hf_logits(hf, ids).sigmoid()[0]
        assert abs(got.outputs.score - float(want)) < 2e-5
    assert len({round(s.outputs.score, 6) for s in scores}) == 3
    by_position = llm.score([query, "Hi"], docs[:2], use_tqdm=False)
    assert by_position[0].outputs.score == pytest.approx(scores[0].outputs.score, abs=1e-6)
    (one,) = llm.classify(query + docs[0], use_tqdm=False)
    assert one.outputs.num_classes == 1 and 0.0 < one.outputs.probs[0] < 1.0


def test_tasks_and_runners_of_a_classifier(classifier: Any, default_model_dir: Path) -> None:
    """A classifier only classifies: "generate", or "embed", is a clear error at start-up; a
    task "classify" (or "score", or a conversion "classify") needs a classifier."""
    folder, _ = classifier
    cls_config = ModelConfig.from_path(folder)
    lm_config = ModelConfig.from_path(default_model_dir)
    for kwargs in ({}, {"task": "classify"}, {"task": "score"}, {"convert": "classify"}):
        config = EngineConfig(**kwargs)
        config.validate()
        config.check_model_task(cls_config)
        assert config.runner == "pooling", kwargs
    for kwargs in ({"runner": "generate"}, {"task": "embed"}, {"convert": "embed"}):
        config = EngineConfig(**kwargs)
        config.validate()
        with pytest.raises(InvalidRequestError, match="sequence-classification model"):
            config.check_model_task(cls_config)
    for kwargs in ({"task": "classify"}, {"convert": "classify"}):
        config = EngineConfig(**kwargs)
        config.validate()
        with pytest.raises(InvalidRequestError, match="causal LM"):
            config.check_model_task(lm_config)
    with pytest.raises(InvalidRequestError, match="does not generate or embed"):
        LLM(str(folder), runner="generate", **SMALL)
    llm = LLM(str(default_model_dir), max_model_len=64, kv_cache_memory=8 << 20)
    with pytest.raises(InvalidRequestError, match="not a sequence-classification model"):
        llm.classify("hi", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="applies to sequence-classification"):
        llm.embed("hi", pooling_params=PoolingParams(activation=True), use_tqdm=False)
