"""The fused mixture-of-experts kernels on a GPU at Qwen3-30B-A3B's shape (128 experts, 8 a
token, hidden 2048, an expert's intermediate 768; bf16): as close to a float32 reference as
the engine's sorted form is, at decode and prompt batch sizes, and replayed from a CUDA graph
with new routing as they run eagerly. Run with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

E, K, H, INTER = 128, 8, 2048, 768


def _layer(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g, device="cuda") / H**0.5
    down = torch.randn(E, H, INTER, generator=g, device="cuda") / INTER**0.5
    return gate_up.bfloat16(), down.bfloat16()


def _inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from baton_engine.models.moe import route

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=g, device="cuda").bfloat16()
    logits = torch.randn(num_tokens, E, generator=g, device="cuda").bfloat16()
    weights, ids = route(logits, K, renormalize=True)
    return x, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 2048])
def test_fused_experts_are_as_exact_as_the_sorted_form(num_tokens: int) -> None:
    from baton_engine.models.moe import experts_sorted, silu_and_mul
    from baton_kernels.fused import silu_and_mul as fused_silu_and_mul
    from baton_kernels.triton.moe import fused_experts

    gate_up, down = _layer(num_tokens)
    x, weights, ids = _inputs(num_tokens, num_tokens + 1)
    truth = experts_sorted(x.float(), ids, weights.float(), gate_up.float(), down.float())
    got = fused_experts(x, ids, weights, gate_up, down, fused_silu_and_mul)
    sorted_form = experts_sorted(x, ids, weights, gate_up, down, silu_and_mul)
    err = (got.float() - truth).abs().max().item()
    sorted_err = (sorted_form.float() - truth).abs().max().item()
    assert truth.abs().max() > 0.5
    assert err <= 1.5 * sorted_err + 1e-3, (err, sorted_err)


def test_fused_experts_replay_from_a_cuda_graph() -> None:
    """Captured once, replayed with other tokens and other routing: the eager result, exactly
    (the same kernels on the same inputs)."""
    from baton_kernels.fused import silu_and_mul
    from baton_kernels.triton.moe import fused_experts

    gate_up, down = _layer(0)
    x, weights, ids = _inputs(24, 1)
    for _ in range(2):  # compile and warm up outside the capture
        fused_experts(x, ids, weights, gate_up, down, silu_and_mul)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
    with torch.cuda.graph(graph):
        out = fused_experts(x, ids, weights, gate_up, down, silu_and_mul)
    for seed in (2, 3):
        new_x, new_weights, new_ids = _inputs(24, seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        want = fused_experts(new_x, new_ids, new_weights, gate_up, down, silu_and_mul)
        assert torch.equal(out, want)
