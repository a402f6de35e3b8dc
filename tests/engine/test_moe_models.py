"""Mixtures of experts in the engine, beyond their greedy parity with transformers
(``test_architectures.py``) and across tensor-parallel ranks (``test_tensor_parallel.py``):
LoRA adapters on what is not an expert, and configs that cannot be served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lora_adapters import merged_greedy, write_adapter
from safetensors.torch import load_file
from tiny_models import build_model

from baton import LLM, LoRARequest, SamplingParams
from baton_engine.errors import InvalidRequestError, ModelLoadError

# tiny_models' qwen2_moe: hidden 64, 4 query heads and 2 KV heads of 16; layer 0 dense
# (intermediate 128), layer 1 a mixture of experts
SHAPES = {
    "q_proj": (64, 64),
    "v_proj": (64, 32),
    "gate_proj": (64, 128),
    "up_proj": (64, 128),
    "down_proj": (128, 64),
}
PROMPTS = [[10 + i for i in range(n)] for n in (5, 23, 40)]
NUM_NEW_TOKENS = 12


def test_adapters_on_the_attention_and_the_dense_layers(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """Each adapter generates what transformers does with it merged into the weights; one
    that names an expert layer's MLP is refused with the reason."""
    model = build_model("qwen2_moe", default_model_dir, tmp_path / "model")
    adapters = {
        "attn": write_adapter(tmp_path / "attn", rank=4, alpha=8, targets=("q_proj", "v_proj"),
                              seed=1, shapes=SHAPES, num_layers=2, scale=0.3),
        # layer 0 only: its MLP is dense
        "dense": write_adapter(tmp_path / "dense", rank=4, alpha=8,
                               targets=("gate_proj", "up_proj", "down_proj"), seed=2,
                               shapes=SHAPES, num_layers=1, scale=0.3),
    }  # fmt: skip
    experts = write_adapter(tmp_path / "experts", rank=4, alpha=8, targets=("down_proj",), seed=3,
                            shapes=SHAPES, num_layers=2)  # fmt: skip
    want = {name: merged_greedy(model, folder, PROMPTS, NUM_NEW_TOKENS)
            for name, folder in adapters.items()}  # fmt: skip
    llm = LLM(str(tmp_path / "model"), dtype="float32", max_model_len=256,
              kv_cache_memory=16 << 20, enable_lora=True, max_lora_rank=8)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        base = [list(g.outputs[0].token_ids) for g in llm.generate(prompts, params)]
        for i, (name, folder) in enumerate(adapters.items(), 1):
            lora = LoRARequest(name, i, str(folder))
            got = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            assert [list(g.outputs[0].token_ids) for g in got] == want[name] != base, name
        with pytest.raises(InvalidRequestError, match="layer 1's MLP is a mixture of experts"):
            llm.generate(prompts, params, lora_request=LoRARequest("experts", 3, str(experts)))
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) <= the number of experts \(8\)"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_configs_that_cannot_be_served_are_refused(
    change: dict[str, object], match: str, default_model_dir: Path, tmp_path: Path
) -> None:
    build_model("qwen3_moe", default_model_dir, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ModelLoadError, match=match):
        LLM(str(tmp_path), dtype="float32", max_model_len=256)


def test_experts_that_do_not_split_evenly_are_refused(
    default_model_dir: Path, tmp_path: Path
) -> None:
    build_model("qwen3_moe", default_model_dir, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"moe_intermediate_size": 33}))
    with pytest.raises(InvalidRequestError, match="experts' intermediate size"):
        LLM(str(tmp_path), dtype="float32", max_model_len=256, tensor_parallel_size=2)


def test_a_checkpoint_missing_one_experts_weight_is_refused(
    default_model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    build_model("mixtral", default_model_dir, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]  # expert 5's up_proj
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
        LLM(str(tmp_path), dtype="float32", max_model_len=256)
