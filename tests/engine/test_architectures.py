"""Each supported architecture, loaded from a Hugging Face folder (config.json + safetensors +
tokenizer), generates greedily exactly as transformers does. The models are tiny and randomly
initialised by transformers itself (nothing is downloaded); the tokenizer is the default model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHITECTURES, build_model

from baton import LLM, SamplingParams


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architecture_matches_transformers(
    name: str, default_model_dir: Path, tmp_path: Path
) -> None:
    model = build_model(name, default_model_dir, tmp_path)
    prompts = [[10 + i for i in range(n)] for n in (5, 23, 40)]
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            want.append(out[0, len(p) :].tolist())
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == want


def test_dummy_weights_run(default_model_dir: Path) -> None:
    llm = LLM(
        str(default_model_dir), load_format="dummy", max_model_len=128, kv_cache_memory=16 << 20
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate(["Hello there"], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_a_sliding_window_model_is_served_up_to_its_window(
    default_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Mistral-7B-v0.1's kind of config: attention over the last 24 tokens. Baton computes
    full attention, the same up to 24 tokens: it serves up to that length, and a longer
    max_model_len is refused rather than answered differently from the model."""
    from baton_engine.errors import InvalidRequestError

    model = build_model("mistral", default_model_dir, tmp_path, sliding_window=24)
    prompt = [10 + i for i in range(14)]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    with caplog.at_level("WARNING"):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20)
    try:
        assert llm.engine.core.max_model_len == 24
        assert any("slides over the last 24 tokens" in r.getMessage() for r in caplog.records)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        (got,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert list(got.outputs[0].token_ids) == out[0, len(prompt) :].tolist()
    finally:
        llm.shutdown()
    with pytest.raises(InvalidRequestError, match="sliding window of 24 tokens"):
        LLM(str(tmp_path), dtype="float32", max_model_len=64)


def test_which_configs_have_a_sliding_window() -> None:
    from baton_engine.config import ModelConfig

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": 100}  # fmt: skip

    def window(arch: str, **cfg: object) -> int | None:
        return ModelConfig.from_hf_dict(shape | {"architectures": [arch]} | cfg).sliding_window

    assert window("MistralForCausalLM", sliding_window=4096) == 4096
    assert window("MistralForCausalLM", sliding_window=None) is None
    # Qwen's configs name a window their layers do not use unless use_sliding_window
    assert window("Qwen2ForCausalLM", sliding_window=32768, use_sliding_window=False) is None
    assert window("Qwen2ForCausalLM", sliding_window=4096, use_sliding_window=True) == 4096
    # transformers >= 5 lists each layer's attention
    full = ["full_attention"] * 2
    assert window("MistralForCausalLM", sliding_window=4096, layer_types=full) is None


def test_hf_overrides_replace_the_configs_keys(default_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's hf_overrides: a folder without rope scaling, served with YaRN's, generates what
    transformers does with YaRN in the config (the same weights)."""
    from baton_engine.errors import InvalidRequestError

    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    build_model("qwen2", default_model_dir, tmp_path / "plain")  # rope_type "default"
    model = build_model("qwen2", default_model_dir, tmp_path / "yarn", rope_scaling=yarn)
    prompt = [10 + i for i in range(40)]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = out[0, len(prompt) :].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {}
    for name, overrides in (("plain", None), ("overridden", json.dumps({"rope_scaling": yarn}))):
        llm = LLM(str(tmp_path / "plain"), dtype="float32", kv_cache_memory=16 << 20,
                  hf_overrides=overrides)  # fmt: skip
        try:
            (result,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            got[name] = list(result.outputs[0].token_ids)
            if overrides:  # the positions YaRN serves: 4 x 64
                assert llm.engine.core.max_model_len == 256
        finally:
            llm.shutdown()
    assert got["overridden"] == want != got["plain"]
    with pytest.raises(InvalidRequestError, match="hf_overrides must be a JSON object"):
        LLM(str(tmp_path / "plain"), hf_overrides="[1]")
