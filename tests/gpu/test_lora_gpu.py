"""LoRA adapters on a GPU: steps with adapters on the Triton backend (CUDA graphs for decode
steps and prompt-step pieces, fused kernels, async scheduling) give the torch reference
backend's greedy tokens (eager; float32, dummy weights), with two adapters and the base model
in every step; the base model's requests also give what an engine without LoRA gives (folded
norms, GEMV layers), whether they share steps with adapters or run alone (the graphs captured
without the adapters' deltas). Run with ``pytest -m gpu``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import write_adapter
from test_engine_gpu import CONFIG, _core, _drain

pytestmark = pytest.mark.gpu


def test_lora_steps_match_reference(tmp_path: Path) -> None:
    from baton_engine.config import ModelConfig
    from baton_engine.lora import TARGETS, LoRARequest, part_shape
    from baton_engine.sampling_params import SamplingParams

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    cfg = ModelConfig.from_path(model)
    shapes = {part: part_shape(cfg, part) for part in TARGETS}
    layers = cfg.num_layers
    loras = [
        None,
        LoRARequest("every", 1, str(write_adapter(
            tmp_path / "every", rank=8, alpha=16, targets=TARGETS, seed=1, shapes=shapes,
            num_layers=layers,
        ))),
        LoRARequest("qv", 2, str(write_adapter(
            tmp_path / "qv", rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=2,
            shapes=shapes, num_layers=layers,
        ))),
    ]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 4000, (20 + 61 * i,), generator=g).tolist() for i in range(6)]

    graph_steps: list[int] = []
    alone: dict[str, list[int]] = {}  # the LoRA engine's base-model requests, before any other
    replays: list[dict[bool, int]] = []  # the LoRA engine's graph replays: decode, pieces

    def run(lora: bool, **overrides: Any) -> dict[str, list[int]]:
        extra = dict(enable_lora=True, max_loras=2, max_lora_rank=8) if lora else {}
        core = _core(model, max_model_len=1024, max_num_seqs=24, **extra, **overrides)
        if lora and overrides["attention_backend"] == "triton":
            for i, prompt in enumerate(prompts):
                core.add_request(f"alone{i}", prompt, params)
            alone.update(_drain(core))
            assert core.scheduler.kv.reset_prefix_cache()  # the next steps compute every prompt
            replays.extend(dict(g.replays) for g in (core.runner.graphs, core.runner.pieces))
        for i, prompt in enumerate(prompts):
            for j, adapter in enumerate(loras if lora else [None]):
                core.add_request(f"p{i}-{j}", prompt, params, lora_request=adapter)
        tokens = _drain(core)
        graphs = core.runner.graphs
        graph_steps.append(0 if graphs is None else graphs.replays[True])
        del core
        return tokens

    reference = run(True, attention_backend="torch", enforce_eager=True)
    triton = run(True, attention_backend="triton")
    plain = run(False, attention_backend="triton")
    assert graph_steps[1] > 0  # the adapters' decode steps replayed their CUDA graphs
    # the base-model steps replayed the graphs without adapters, decode and prompt pieces
    assert all(r[False] > 0 and r[True] == 0 for r in replays), replays
    assert triton == reference
    for i in range(len(prompts)):
        assert triton[f"p{i}-0"] == plain[f"p{i}-0"]  # the base model, as without LoRA
        assert alone[f"alone{i}"] == plain[f"p{i}-0"]
        # each adapter changes the answer
        assert len({tuple(triton[f"p{i}-{j}"]) for j in range(3)}) == 3, i
