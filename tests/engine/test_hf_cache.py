"""Models (and LoRA adapters) named as vLLM names them, by Hugging Face repository id, are read
from the local Hugging Face cache (``$HF_HUB_CACHE``), never downloaded: the same engine as on
the snapshot's folder, listed under the id itself; an id the cache does not hold is a clear
error."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_adapters import write_adapter
from tiny_models import build_model

from baton import LLM, LoRARequest, SamplingParams
from baton_engine.errors import ModelLoadError
from baton_engine.model_files import (
    load_model_tokenizer,
    model_source,
    resolve_model,
    served_model_name,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_entry(hub: Path, repo_id: str) -> Path:
    """The snapshot folder (not made yet) of ``repo_id`` in a Hugging Face cache laid out as the
    hub client lays it out (``refs/main`` names the snapshot)."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "snapshots").mkdir()
    return repo / "snapshots" / COMMIT


def test_a_cached_repository_id_serves_its_snapshot(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "hub"
    snapshot = cache_entry(hub, "test-org/tiny-llama")
    build_model("llama", default_model_dir, snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))

    assert model_source("test-org/tiny-llama") == snapshot.resolve()
    assert resolve_model("test-org/tiny-llama") == snapshot.resolve()
    assert served_model_name("test-org/tiny-llama") == "test-org/tiny-llama"
    ids = load_model_tokenizer("test-org/tiny-llama")("Hello there").input_ids
    assert ids == load_model_tokenizer(str(snapshot))("Hello there").input_ids

    small = dict(dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (by_id,) = LLM("test-org/tiny-llama", **small).generate("Hello", greedy, use_tqdm=False)
    (by_path,) = LLM(str(snapshot), **small).generate("Hello", greedy, use_tqdm=False)
    assert by_id.outputs[0].token_ids == by_path.outputs[0].token_ids

    with pytest.raises(
        ModelLoadError, match=r"neither a local path nor in the local Hugging Face cache.*never"
    ):
        LLM("test-org/not-cached", **small)


def test_a_lora_adapter_by_repository_id(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "hub"
    snapshot = cache_entry(hub, "test-org/smol-adapter")
    write_adapter(snapshot, rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=3)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    llm = LLM(
        str(default_model_dir), enable_lora=True, max_lora_rank=4, max_model_len=128,
        kv_cache_memory=16 << 20,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = [
        llm.generate("Once upon a time", greedy, lora_request=lora, use_tqdm=False)[0]
        for lora in (
            LoRARequest("by-id", 1, "test-org/smol-adapter"),
            LoRARequest("by-path", 2, str(snapshot)),
            None,
        )
    ]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids  # (it does change them)
    with pytest.raises(Exception, match="nor in the local Hugging Face cache"):
        llm.generate("Hi", greedy, lora_request=LoRARequest("x", 3, "test-org/nope"))
