"""LoRA adapters, written as PEFT saves them, with random weights large enough to change a
model's answers (nothing is downloaded): for the default model (SmolLM2-135M) unless given
another model's projection shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, intermediate 1536, 30 layers
SHAPES = {
    "q_proj": (576, 576),
    "k_proj": (576, 192),
    "v_proj": (576, 192),
    "o_proj": (576, 576),
    "gate_proj": (576, 1536),
    "up_proj": (576, 1536),
    "down_proj": (1536, 576),
}
NUM_LAYERS = 30


def write_adapter(
    folder: Path,
    *,
    rank: int,
    alpha: float,
    targets: tuple[str, ...],
    seed: int,
    rslora: bool = False,
    binary: bool = False,
    extra: dict[str, Any] | None = None,
    shapes: dict[str, tuple[int, int]] = SHAPES,
    num_layers: int = NUM_LAYERS,
    scale: float = 0.05,
) -> Path:
    """A PEFT adapter folder with random ``lora_A`` and ``lora_B`` (normal, times ``scale``)
    for ``targets`` of every layer; ``shapes``: each projection's ``(in, out)``."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for part in targets:
            in_f, out_f = shapes[part]
            owner = (
                "mlp"
                if part in ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
                else "self_attn"
            )
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{part}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * scale
    folder.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "use_rslora": rslora,
        "bias": "none",
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        **(extra or {}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if binary:
        torch.save(tensors, folder / "adapter_model.bin")
    else:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def merged_greedy(
    model: torch.nn.Module, adapter: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy tokens of ``prompts`` (token ids) with ``adapter`` (safetensors,
    no rsLoRA) merged into ``model``'s weights (``W + scale * B @ A``), restored afterwards."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    deltas = {
        key.removeprefix("base_model.model.").replace(".lora_A", ""): scale
        * (tensors[key.replace(".lora_A.", ".lora_B.")] @ a)
        for key, a in tensors.items()
        if ".lora_A." in key
    }
    out = []
    with torch.no_grad():
        for target, delta in deltas.items():
            params[target] += delta
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids),  # type: ignore[operator]
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
            out.append(gen[0, len(p) :].tolist())
        for target, delta in deltas.items():
            params[target] -= delta
    return out
