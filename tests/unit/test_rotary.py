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


@pytest.mark.parametrize("longrope", [False, True])
def test_a_partial_rotation_turns_the_reordered_dimensions(longrope: bool) -> None:
    """Phi-4-mini's kind (96 of a head's 128 dimensions turned, LongRoPE or not): the table
    applied to q with each head's dimensions in ``partial_rotation_order`` gives transformers'
    partial rotation in that order: the other dimensions pass unchanged (unscaled by
    LongRoPE's attention factor)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    from baton_engine.models.rotary import partial_rotation_order, reorder_heads

    cfg = SHAPE | {"partial_rotary_factor": 0.75, "rope_theta": 10000.0}
    if longrope:
        cfg |= {"rope_scaling": _longrope(96), "original_max_position_embeddings": 1024}
    mc = ModelConfig.from_hf_dict(cfg | {"architectures": ["Phi3ForCausalLM"]})
    assert (mc.head_dim, mc.rotary_dim) == (128, 96)
    rotary = RotaryEmbedding(mc.head_dim, 3000, mc.rope_theta, mc.rope_scaling, mc.rotary_dim)
    order = partial_rotation_order(128, 96)
    assert sorted(order.tolist()) == list(range(128))
    at = torch.tensor([0, 5, 700, 2999])
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 32, generator=g), torch.randn(4 * 128, 32, generator=g)  # 4 heads
    q = (x @ w.t()).view(4, 4, 128)  # [T, heads, D]
    hf = Phi3RotaryEmbedding(Phi3Config(**cfg))
    cos, sin = hf(q, at[None])
    want, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
    want = want[0].transpose(0, 1)  # [T, heads, D]
    # the projection's rows loaded in the order: each head's dimensions reordered
    ours = (x @ reorder_heads(w, order).t()).view(4, 4, 128)
    torch.testing.assert_close(ours, q[..., order])
    got = rotary(at, torch.float32).apply(ours)
    torch.testing.assert_close(got, want[..., order], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want[..., 96:], q[..., 96:])  # (unturned)


def test_a_partial_rotation_needs_an_even_number_of_dimensions() -> None:
    nested = {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.2}}
    for where in ({"partial_rotary_factor": 0.2}, nested):  # (25 of 128)
        with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.2 turns 25 of a head's"):
            ModelConfig.from_hf_dict(SHAPE | where)
    assert ModelConfig.from_hf_dict(SHAPE | {"partial_rotary_factor": 1.0}).rotary_dim == 0
