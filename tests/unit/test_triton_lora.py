"""The LoRA expand kernel (``baton_kernels.triton.lora``) against its plain-PyTorch reference and
against each token's own adapter computed alone. Without a GPU it runs under Triton's
interpreter at small shapes (TRITON_INTERPRET is set before any kernel module is imported)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from baton_kernels.triton.lora import lora_expand, ref_lora_expand

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol): one rounding of the output; the reference's float32 sum is in another order
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


def _inputs(
    num_tokens: int, out_f: int, slots: int, width: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y_ext = torch.randn(num_tokens, out_f + slots * width, generator=g).to(dtype)
    b_t = (torch.randn(slots * width, out_f, generator=g) * 0.3).to(dtype)
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g)
    return y_ext.to(DEVICE), token_slots.to(DEVICE), b_t.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_tokens", "out_f", "slots", "width"), [
    (1, 48, 2, 16), (5, 96, 3, 8), (17, 80, 4, 24), (40, 130, 1, 16),
])  # fmt: skip
def test_lora_expand_matches_reference(
    dtype: torch.dtype, num_tokens: int, out_f: int, slots: int, width: int
) -> None:
    y_ext, token_slots, b_t = _inputs(num_tokens, out_f, slots, width, dtype)
    out = torch.full((num_tokens, out_f), float("nan"), dtype=dtype, device=DEVICE)
    got = lora_expand(y_ext, token_slots, b_t, width, out=out)
    assert got.data_ptr() == out.data_ptr()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, ref_lora_expand(y_ext, token_slots, b_t, width),
                               atol=atol, rtol=rtol)  # fmt: skip


def test_each_token_reads_only_its_own_slot() -> None:
    """Another slot's columns never reach a token, even non-finite ones; a token without a slot
    gets the base output exactly."""
    num_tokens, out_f, slots, width = 9, 64, 3, 16
    y_ext, _, b_t = _inputs(num_tokens, out_f, slots, width, torch.float32, seed=1)
    token_slots = torch.tensor([0, 2, -1, 1, 1, -1, 2, 0, 2], device=DEVICE)
    poisoned = y_ext.clone()
    for t, slot in enumerate(token_slots.tolist()):
        for other in range(slots):
            if other != slot:
                poisoned[t, out_f + other * width : out_f + (other + 1) * width] = float("inf")
    got = lora_expand(poisoned, token_slots, b_t, width)
    for t, slot in enumerate(token_slots.tolist()):
        expected = y_ext[t, :out_f]
        if slot >= 0:
            cols = slice(out_f + slot * width, out_f + (slot + 1) * width)
            expected = expected + y_ext[t, cols] @ b_t[slot * width : (slot + 1) * width]
        torch.testing.assert_close(got[t], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2], y_ext[2, :out_f])


def test_lora_expand_refuses_mismatched_shapes() -> None:
    y_ext, token_slots, b_t = _inputs(4, 32, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="does not hold"):
        lora_expand(y_ext[:, :-1], token_slots, b_t, 8)
    with pytest.raises(ValueError, match="slots must be"):
        lora_expand(y_ext, token_slots[:3], b_t, 8)
    with pytest.raises(ValueError, match="unsupported dtypes"):
        lora_expand(y_ext, token_slots, b_t.half(), 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_with_the_kernel_matches_each_tokens_adapter(dtype: torch.dtype) -> None:
    """A fused qkv projection (with bias) and two adapter slots, one adapter on q, k and v and
    one on q and v only: with the expand kernel (the slots' A below the base weight) each token
    gets its own adapter's delta, as with the masked GEMMs and as computed by hand; without
    adapters in the step, the base projection's output exactly."""
    from types import SimpleNamespace
    from typing import cast

    from torch import nn

    from baton_engine.config import ModelConfig
    from baton_engine.lora import LoRAAdapter, LoRABatch, LoRALinear, part_shape

    cfg = cast(ModelConfig, SimpleNamespace(
        hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
    ))  # fmt: skip
    parts = ("q_proj", "k_proj", "v_proj")
    g = torch.Generator().manual_seed(3)
    base = nn.Linear(32, 64, bias=True).to(dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(64, 32, generator=g) * 0.2)
        base.bias.copy_(torch.randn(64, generator=g))

    def adapter(name: str, rank: int, targets: tuple[str, ...]) -> LoRAAdapter:
        weights = {}
        for part in targets:
            in_f, out_f = part_shape(cfg, part)
            weights[0, part] = (torch.randn(rank, in_f, generator=g) * 0.3,
                                torch.randn(out_f, rank, generator=g) * 0.3)  # fmt: skip
        return LoRAAdapter(name, "/nowhere", rank, weights)

    adapters = [adapter("all", 4, parts), adapter("qv", 2, ("q_proj", "v_proj"))]
    slots = torch.tensor([1, -1, 0, 0, 1, -1, 1], device=DEVICE)
    x = torch.randn(7, 32, generator=g).to(dtype).to(DEVICE)
    plain = base.to(DEVICE)(x).detach()
    outputs = {}
    for kernel in (True, False):
        batch = LoRABatch(2, 16, dtype, DEVICE)
        layer = LoRALinear(
            nn.Linear(32, 64).to(dtype).to(DEVICE).requires_grad_(False), parts, cfg, 2, 4,
            batch, dtype, DEVICE, expand_kernel=kernel,
        )  # fmt: skip
        with torch.no_grad():
            layer.base.weight.copy_(base.weight)
            layer.base.bias.copy_(base.bias)
        for slot, a in enumerate(adapters):
            layer.set_slot(slot, 0, a)
        assert torch.equal(layer(x), plain)  # batch.active is off: the base model alone
        if kernel:
            assert layer.w_ext is not None
            assert layer.base.weight.data_ptr() == layer.w_ext.data_ptr()
        batch.set(slots)
        batch.active = True
        outputs[kernel] = layer(x)
    expected = plain.float().clone()
    offsets = [0, 32, 48, 64]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for j, part in enumerate(parts):
            pair = adapters[slot].weights.get((0, part))
            if pair is not None:
                a, b = (w.to(dtype).float().to(DEVICE) for w in pair)
                expected[t, offsets[j] : offsets[j + 1]] += b @ (a @ x[t].float())
    atol, rtol = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}[dtype]
    torch.testing.assert_close(outputs[True].float(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(outputs[True], outputs[False], atol=atol, rtol=rtol)
