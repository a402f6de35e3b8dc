"""The rotary tables of each rope scaling equal transformers' cos and sin (its attention factor
included), and the positions served follow the scaling as vLLM derives them."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from baton_engine.config import ModelConfig
from baton_engine.models.rotary import RotaryEmbedding

SHAPE = {"hidden_size": 512, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "vocab_size": 100, "rope_theta": 1000000.0,
         "max_position_embeddings": 4096}  # fmt: skip


YARN_MSCALE = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
               "beta_fast": 16, "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}  # fmt: skip


@pytest.mark.parametrize(
    ("scaling", "positions"),
    [
        (None, 4096),
        ({"rope_type": "linear", "factor": 2.0}, 8192),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096),
        ({"rope_type": "yarn", "factor": 4.0}, 16384),  # original: max_position_embeddings
        (YARN_MSCALE, 8192),
        (LLAMA3, 4096),
    ],
)
def test_tables_equal_transformers(scaling: dict[str, Any] | None, positions: int) -> None:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    cfg = SHAPE | ({"rope_scaling": scaling} if scaling else {})
    mc = ModelConfig.from_hf_dict(cfg | {"architectures": ["Qwen2ForCausalLM"]})
    assert mc.max_position_embeddings == positions
    ours = RotaryEmbedding(mc.head_dim, 6000, mc.rope_theta, mc.rope_scaling).cos_sin
    hf = Qwen2RotaryEmbedding(Qwen2Config(**cfg))
    at = torch.tensor([[0, 1, 17, 1000, 3000, 5999]])
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), at)
    torch.testing.assert_close(ours[at[0], 0], cos[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[at[0], 1], sin[0], atol=1e-5, rtol=1e-5)


def _longrope(head_dim: int) -> dict[str, Any]:
    half = head_dim // 2
    return {"type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)]}  # fmt: skip


@pytest.mark.parametrize(
    ("max_model_len", "at"), [(1024, [0, 1, 17, 1000, 1023]), (6000, [0, 17, 1000, 3000, 5999])]
)
def test_longrope_tables_equal_transformers(max_model_len: int, at: list[int]) -> None:
    """Phi-3's LongRoPE (its original context 1,024 here, 4,096 served): an engine serving at
    most the original context takes the short factors, one serving more the long ones, each
    as transformers rotates a sequence of that length (its attention factor from 4,096 /
    1,024 in both)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cfg = SHAPE | {"rope_scaling": _longrope(128), "original_max_position_embeddings": 1024,
                   "rope_theta": 10000.0}  # fmt: skip
    mc = ModelConfig.from_hf_dict(cfg | {"architectures": ["Phi3ForCausalLM"]})
    assert mc.max_position_embeddings == 4096
    ours = RotaryEmbedding(mc.head_dim, max_model_len, mc.rope_theta, mc.rope_scaling).cos_sin
    hf = Phi3RotaryEmbedding(Phi3Config(**cfg))
    positions = torch.tensor([at])
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(ours[positions[0], 0], cos[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[positions[0], 1], sin[0], atol=1e-5, rtol=1e-5)
    assert abs(cos[0, 0, 0].item() - (1 + math.log(4) / math.log(1024)) ** 0.5) < 1e-6


def test_longrope_needs_a_factor_a_frequency() -> None:
    scaling = _longrope(128) | {"rope_type": "longrope", "factor": 4.0,
                                "original_max_position_embeddings": 1024}  # fmt: skip
    scaling["long_factor"] = scaling["long_factor"][:-1]
    with pytest.raises(ValueError, match="longrope's long_factor must list 64 factors"):
        RotaryEmbedding(128, 2048, 10000.0, scaling)
    RotaryEmbedding(128, 1024, 10000.0, scaling)  # (the short factors are whole)


def test_an_unsupported_scaling_is_named() -> None:
    with pytest.raises(ValueError, match=r"unsupported rope scaling 'dynamic' \(supported: "):
        RotaryEmbedding(64, 16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_a_partial_rotation_is_refused() -> None:
    """(Phi-4-mini's kind: a rotation of part of each head, which the kernels do not do.)"""
    nested = {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.75}}
    for where in ({"partial_rotary_factor": 0.75}, nested):
        with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.75 is not supported"):
            ModelConfig.from_hf_dict(SHAPE | where)
