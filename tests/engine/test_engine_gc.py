"""The engine and Python's cyclic garbage collector: what the engine holds from its start-up on
(the KV pool's blocks, ~600k objects on a GPU, the model, the runner) must not be walked by the
collector's young-generation passes during steps, which made single steps stall for ~45 ms on
the H200 (benchmarks/device/step_timeline.py)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.sampling_params import SamplingParams

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}


def test_start_up_heap_is_in_the_oldest_generation(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    core = EngineCore(
        EngineConfig(
            model=str(tmp_path),
            load_format="dummy",
            dtype="float32",
            max_model_len=128,
            num_gpu_blocks_override=4096,
        )
    )
    oldest = {id(obj) for obj in gc.get_objects(generation=2)}
    blocks = core.kv.pool.blocks
    assert len(blocks) == 4096
    assert all(id(block) in oldest for block in blocks)
    assert id(core.runner) in oldest and id(core.scheduler) in oldest
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    core.add_request("a", [5, 6, 7], params)
    while core.has_unfinished_requests():
        core.step()
    assert core.num_generated_tokens == 4
