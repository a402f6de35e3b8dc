"""Engine defaults that depend on where the engine runs, as vLLM picks them."""

from __future__ import annotations

import pytest
import torch

from baton_engine.config import EngineConfig, large_gpu

GIB = 1 << 30


def test_step_budget_on_cpus() -> None:
    assert EngineConfig(model="m").resolved_max_num_batched_tokens() == 8192
    serving = EngineConfig(model="m", usage_context="serving")
    assert serving.resolved_max_num_batched_tokens() == 512
    chosen = EngineConfig(model="m", max_num_batched_tokens=300)
    assert chosen.resolved_max_num_batched_tokens() == 300


def test_which_gpus_get_the_larger_offline_budget() -> None:
    assert large_gpu(141 * GIB, "NVIDIA H200")
    assert large_gpu(80 * GIB, "NVIDIA H100 80GB HBM3")
    assert not large_gpu(80 * GIB, "NVIDIA A100-SXM4-80GB")
    assert not large_gpu(48 * GIB, "NVIDIA L40S")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_budget_on_this_gpu() -> None:
    props = torch.cuda.get_device_properties(0)
    want = 16384 if large_gpu(props.total_memory, props.name) else 8192
    assert EngineConfig(model="m", device="cuda").resolved_max_num_batched_tokens() == want
    serving = EngineConfig(model="m", device="cuda", usage_context="serving")
    assert serving.resolved_max_num_batched_tokens() == 2048
