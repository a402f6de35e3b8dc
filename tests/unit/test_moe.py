"""The mixture-of-experts MLP: routing and the experts' sum equal transformers' (Qwen3-MoE's
modules, fed the same weights), and the static-shape forms a CUDA graph runs equal the sorted
form that every other step runs."""

from __future__ import annotations

import pytest
import torch

from baton_engine.models.moe import (
    experts_dense,
    experts_gathered,
    experts_sorted,
    route,
    silu_and_mul,
)
from baton_kernels.cpu_linear import vnni_ops

E, H, INTER = 8, 64, 48  # experts, hidden, an expert's intermediate size


def _hf_config(top_k: int, renormalize: bool) -> object:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=top_k,
        norm_topk_prob=renormalize,
    )


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_routing_and_experts_equal_transformers(top_k: int, renormalize: bool) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeExperts,
        Qwen3MoeTopKRouter,
    )

    torch.manual_seed(top_k)
    cfg = _hf_config(top_k, renormalize)
    router, experts = Qwen3MoeTopKRouter(cfg), Qwen3MoeExperts(cfg)
    with torch.no_grad():
        router.weight.normal_()
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    x = torch.randn(37, H)
    with torch.no_grad():
        _, want_weights, want_ids = router(x)
        want = experts(x, want_ids, want_weights)
        weights, ids = route(torch.nn.functional.linear(x, router.weight), top_k, renormalize)
        got = experts_sorted(x, ids, weights, experts.gate_up_proj, experts.down_proj)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights)
    # (each expert's GEMM sees its rows in another order: equal to a rounding)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 64])  # T * k up to E: the gather's cases
def test_static_shape_forms_equal_the_sorted_one(num_tokens: int, dtype: torch.dtype) -> None:
    torch.manual_seed(num_tokens)
    top_k = 2
    x = torch.randn(num_tokens, H, dtype=dtype)
    gate_up = torch.randn(E, 2 * INTER, H, dtype=dtype) * 0.2
    down = torch.randn(E, H, INTER, dtype=dtype) * 0.2
    weights, ids = route(torch.randn(num_tokens, E, dtype=dtype), top_k, renormalize=True)
    want = experts_sorted(x, ids, weights, gate_up, down)
    assert want.abs().max() > 0.1  # (not a sum of nothing)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    for form in (experts_gathered, experts_dense):
        torch.testing.assert_close(form(x, ids, weights, gate_up, down), want, **tol)


def test_an_expert_no_token_chose_adds_nothing() -> None:
    """Tokens routed to experts 2 and 5 only: the other experts' weights (NaN here) are
    never read by the sorted and gathered forms."""
    torch.manual_seed(0)
    x = torch.randn(5, H)
    gate_up = torch.full((E, 2 * INTER, H), float("nan"))
    down = torch.full((E, H, INTER), float("nan"))
    for e in (2, 5):
        gate_up[e].normal_(0, 0.2)
        down[e].normal_(0, 0.2)
    ids = torch.tensor([[2, 5]] * 5)
    weights = torch.tensor([[0.75, 0.25]] * 5)
    want = 0.75 * _expert(x, gate_up[2], down[2]) + 0.25 * _expert(x, gate_up[5], down[5])
    for form in (experts_sorted, experts_gathered):
        torch.testing.assert_close(form(x, ids, weights, gate_up, down), want)


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.t()


@pytest.mark.skipif(vnni_ops() is None, reason="no AVX512-BF16 GEMM on this CPU")
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_packed_experts_equal_the_stacked_ones(num_tokens: int) -> None:
    """(bf16 on a CPU: each expert's weights packed for the AVX512-BF16 GEMM.)"""
    from baton_engine.models.moe import Experts

    torch.manual_seed(num_tokens)
    stacked, packed = Experts(E, H, INTER), Experts(E, H, INTER)
    with torch.no_grad():
        stacked.gate_up_proj.normal_(0, 0.2)
        stacked.down_proj.normal_(0, 0.2)
        stacked.to(torch.bfloat16)
        packed.load_state_dict(stacked.state_dict())
        packed.to(torch.bfloat16)
    assert packed.pack() and packed.gate_up_proj.numel() == 0  # (the stacked copy dropped)
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16)
    weights, ids = route(torch.randn(num_tokens, E, dtype=torch.bfloat16), 2, renormalize=True)
    want = stacked.sorted(x, ids, weights, silu_and_mul)
    got = packed.sorted(x, ids, weights, silu_and_mul)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 24])  # 2 T k <= E: gathered; beyond: dense
def test_a_captured_step_runs_a_static_shape_form(
    num_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer under CUDA-graph capture (simulated here: the capture test made true) runs
    a form without host work, and answers what the eager layer does."""
    from baton_engine.config import ModelConfig
    from baton_engine.models import moe

    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": H, "intermediate_size": 128,
        "moe_intermediate_size": INTER, "num_experts": E, "num_experts_per_tok": 2,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100,
    })  # fmt: skip
    torch.manual_seed(num_tokens)
    layer = moe.SparseMoE(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(num_tokens, H)
    with torch.no_grad():
        want = layer(x)
        ran: list[str] = []
        for name in ("experts_gathered", "experts_dense"):
            form = getattr(moe, name)
            monkeypatch.setattr(
                moe, name, lambda *a, f=form, n=name, **k: ran.append(n) or f(*a, **k)
            )
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        got = layer(x)
    assert ran == ["experts_gathered" if 2 * num_tokens * 2 <= E else "experts_dense"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
