"""Embeddings offline (``LLM.embed``, ``PoolingParams``), as vLLM's: the final hidden state at
the prompt's last token, L2-normalized; equal to Hugging Face transformers' and the same however
the engine computes the prompt (alone, batched with generation, in chunks, from the prefix
cache)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM, PoolingParams, SamplingParams
from baton_engine.config import EngineConfig
from baton_engine.engine import LLMEngine
from baton_engine.errors import InvalidRequestError

TEXTS = [
    "The capital of France is Paris.",
    "A tokenizer splits text into tokens; " * 12,  # longer than a step's budget: chunked
    "def add(a, b):\n    return a + b",
]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    # A step takes at most 48 tokens: the long prompt is computed in several chunks. float32,
    # as transformers' reference (the model's bfloat16 would differ from it by rounding).
    return LLM(
        str(default_model_dir),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=48,
        kv_cache_memory=64 << 20,
    )


@pytest.fixture(scope="module")
def hf_hidden(tokenizer: Any, hf_model: Any) -> list[torch.Tensor]:
    """transformers' final hidden states (after the last norm) of each text's tokens
    (``[tokens, hidden]``), from its own GGUF loading."""
    with torch.inference_mode():
        return [
            hf_model.model(torch.tensor([tokenizer(t).input_ids])).last_hidden_state[0]
            for t in TEXTS
        ]


@pytest.fixture(scope="module")
def hf_last_hidden(hf_hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """... at each text's last token."""
    return [h[-1] for h in hf_hidden]


def close(a: list[float], b: list[float] | torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(a), torch.as_tensor(b), atol=2e-4, rtol=1e-3)


def test_embeddings_match_transformers(llm: LLM, hf_last_hidden: list[torch.Tensor]) -> None:
    outs = llm.embed(TEXTS, use_tqdm=False)
    tok = llm.get_tokenizer()
    assert len(outs) == len(TEXTS)
    for out, text, want in zip(outs, TEXTS, hf_last_hidden, strict=True):
        assert out.finished and out.prompt_token_ids == tok(text).input_ids
        assert out.outputs.hidden_size == 576  # SmolLM2-135M's hidden size
        assert math.isclose(sum(v * v for v in out.outputs.embedding), 1.0, rel_tol=1e-5)
        close(out.outputs.embedding, torch.nn.functional.normalize(want, dim=0))
    (raw,) = llm.embed(TEXTS[:1], pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    close(raw.outputs.embedding, hf_last_hidden[0])


def test_same_embedding_however_computed(llm: LLM) -> None:
    """Alone, batched, chunked, from the prefix cache, and beside generating requests."""
    alone = [llm.embed(t, use_tqdm=False)[0].outputs.embedding for t in TEXTS]
    again = llm.embed(TEXTS, use_tqdm=False)  # every prompt's blocks are cached now
    assert again[1].num_cached_tokens > 0
    for got, want in zip(again, alone, strict=True):
        close(got.outputs.embedding, want)

    engine: LLMEngine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    (reference,) = llm.generate("Once upon a time", greedy, use_tqdm=False)
    engine.add_request("gen", "Once upon a time", greedy)
    for i, text in enumerate(TEXTS):
        engine.add_request(f"emb{i}", text + " (again)", PoolingParams())
    done: dict[str, Any] = {}
    for _ in range(200):  # bounded: 13 steps at most here
        if not engine.has_unfinished_requests():
            break
        done.update((out.request_id, out) for out in engine.step())
    assert sorted(done) == ["emb0", "emb1", "emb2", "gen"]
    assert done["gen"].outputs[0].token_ids == reference.outputs[0].token_ids
    direct = llm.embed([t + " (again)" for t in TEXTS], use_tqdm=False)
    for i, want in enumerate(direct):
        close(done[f"emb{i}"].outputs.embedding, want.outputs.embedding)


def test_embedding_params_and_errors(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok(TEXTS[1]).input_ids
    cut, tail = llm.embed(
        [TEXTS[1], {"prompt_token_ids": ids[-5:]}],
        pooling_params=[PoolingParams(truncate_prompt_tokens=5), PoolingParams()],
        use_tqdm=False,
    )
    assert cut.prompt_token_ids == ids[-5:]
    close(cut.outputs.embedding, tail.outputs.embedding)
    (kept,) = llm.embed("word " * 300, truncate_prompt_tokens=-1, use_tqdm=False)
    assert len(kept.prompt_token_ids) == 256  # a whole context: nothing is left to generate
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.embed("word " * 300, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.embed({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="out of range"):
        llm.embed({"prompt_token_ids": [1, 10**7]}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        llm.embed("hi", pooling_params=PoolingParams(dimensions=64), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="PoolingParams"):
        llm.embed("hi", pooling_params=SamplingParams(), use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        llm.generate("hi", PoolingParams(), use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="2 prompts but 1"):
        llm.embed(["a", "b"], pooling_params=[PoolingParams()], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        PoolingParams(dimensions=0)
    # The engine serves on after every refusal.
    assert llm.embed("hi", use_tqdm=False)[0].outputs.hidden_size == 576


def test_matryoshka_dimensions(default_model_dir: Path, tmp_path: Path) -> None:
    """A model whose config lists ``matryoshka_dimensions`` may cut its embeddings to one of
    them: the first N values of the raw hidden state, normalized."""
    for f in default_model_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    config = json.loads((default_model_dir / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [64]}))
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    raw, cut = llm.embed(
        ["Hello there", "Hello there"],
        pooling_params=[PoolingParams(normalize=False), PoolingParams(dimensions=64)],
        use_tqdm=False,
    )
    assert len(cut.outputs.embedding) == 64
    close(
        cut.outputs.embedding,
        torch.nn.functional.normalize(torch.tensor(raw.outputs.embedding[:64]), dim=0),
    )
    with pytest.raises(InvalidRequestError, match=r"one of \[64\]"):
        llm.embed("hi", pooling_params=PoolingParams(dimensions=32), use_tqdm=False)


def test_mean_and_cls_pooling(
    default_model_dir: Path, tmp_path: Path, hf_hidden: list[torch.Tensor]
) -> None:
    """``pooler_config`` (vLLM's ``--pooler-config``) picks MEAN pooling, a model folder's
    sentence-transformers ``Pooling`` module CLS; each embedding equals transformers' hidden
    states pooled the same way, computed in chunks, and again when the prompt's blocks are
    cached (these poolings read every prompt token: no prefix-cache hits)."""
    small = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=48,
                 kv_cache_memory=64 << 20)  # fmt: skip
    mean = LLM(str(default_model_dir), pooler_config='{"pooling_type": "MEAN"}', **small)
    for _ in range(2):
        outs = mean.embed(TEXTS, use_tqdm=False)
        for out, hidden in zip(outs, hf_hidden, strict=True):
            assert out.num_cached_tokens == 0
            close(out.outputs.embedding, torch.nn.functional.normalize(hidden.mean(0), dim=0))
    del mean

    for f in default_model_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    st_pooling = {"word_embedding_dimension": 576, "pooling_mode_cls_token": True,
                  "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False}  # fmt: skip
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(st_pooling))
    cls = LLM(str(tmp_path), pooler_config='{"normalize": false}', **small)
    for out, hidden in zip(cls.embed(TEXTS, use_tqdm=False), hf_hidden, strict=True):
        close(out.outputs.embedding, hidden[0])  # the first token's, not normalized
    (normed,) = cls.embed(TEXTS[:1], pooling_params=PoolingParams(normalize=True), use_tqdm=False)
    close(normed.outputs.embedding, torch.nn.functional.normalize(hf_hidden[0][0], dim=0))
    del cls

    st_pooling["pooling_mode_max_tokens"] = True
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(st_pooling))
    with pytest.raises(InvalidRequestError, match="pooling_mode_cls_token, pooling_mode_max"):
        LLM(str(tmp_path), **small)
    for bad, message in (
        ('{"pooling_type": "MAX"}', "pooling_type 'MAX' is not supported"),
        ('{"softmax": true}', "softmax not supported"),
        ("MEAN", "not JSON"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            LLM(str(default_model_dir), pooler_config=bad, **small)


def test_runner_restricts_what_an_engine_serves(default_model_dir: Path) -> None:
    """vLLM's ``runner``: "pooling" embeds only, "generate" generates only; Baton's default,
    "auto", does both (the other tests)."""
    small = dict(max_model_len=64, kv_cache_memory=8 << 20)
    pooling = LLM(str(default_model_dir), runner="pooling", **small)
    assert pooling.embed("hi", use_tqdm=False)[0].outputs.hidden_size == 576
    with pytest.raises(InvalidRequestError, match="runner='pooling'"):
        pooling.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    del pooling
    generate = LLM(str(default_model_dir), runner="generate", **small)
    (out,) = generate.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(InvalidRequestError, match="runner='generate'"):
        generate.embed("hi", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="runner must be one of"):
        LLM(str(default_model_dir), runner="embed", **small)
    # vLLM's older --task and its --convert name the runner too
    embedder = LLM(str(default_model_dir), task="embed", **small)
    assert embedder.engine.core.config.runner == "pooling"
    assert embedder.embed("hi", use_tqdm=False)[0].outputs.hidden_size == 576
    del embedder
    for kwargs, runner in (
        ({"convert": "embed"}, "pooling"),
        ({"task": "embedding", "runner": "pooling"}, "pooling"),
        ({"task": "generate"}, "generate"),
        ({"convert": "none"}, "auto"),
    ):
        config = EngineConfig(model=str(default_model_dir), **kwargs)
        config.validate()
        assert config.runner == runner, kwargs
    for kwargs, message in (
        ({"task": "reward"}, "task 'reward' is not supported"),
        ({"convert": "reward"}, "convert 'reward' is not supported"),
        ({"runner": "generate", "convert": "embed"}, "needs runner 'pooling'"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            EngineConfig(model=str(default_model_dir), **kwargs).validate()


def test_score(llm: LLM) -> None:
    """vLLM's ``LLM.score`` as embedding models answer it: cosine similarities of the texts'
    embeddings, one text against many or lists paired by position."""
    embedded = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]

    def cos(i: int, j: int) -> float:
        return float(torch.nn.functional.cosine_similarity(
            torch.tensor(embedded[i]), torch.tensor(embedded[j]), dim=0
        ))  # fmt: skip

    one_to_many = llm.score(TEXTS[0], TEXTS, use_tqdm=False)
    assert [round(o.outputs.score, 4) for o in one_to_many] == [
        round(cos(0, j), 4) for j in range(3)
    ]
    assert abs(one_to_many[0].outputs.score - 1.0) < 1e-5
    by_position = llm.score(TEXTS[:2], TEXTS[1:], use_tqdm=False)
    assert [round(o.outputs.score, 4) for o in by_position] == [
        round(cos(0, 1), 4),
        round(cos(1, 2), 4),
    ]
    with pytest.raises(InvalidRequestError, match="pair by position"):
        llm.score(TEXTS[:2], TEXTS, use_tqdm=False)
