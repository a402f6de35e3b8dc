"""Each supported architecture, loaded from a Hugging Face folder (config.json + safetensors +
tokenizer), generates greedily exactly as transformers does. The models are tiny and randomly
initialised by transformers itself (nothing is downloaded); the tokenizer is the default model's.
"""

from __future__ import annotations

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
