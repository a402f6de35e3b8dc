"""The fused mixture-of-experts kernels (``baton_kernels.triton.moe``): the router's top-k
against the engine's ``route``, the pairs' grouping by expert, and the experts' weighted sum
against its plain-PyTorch reference and against the engine's sorted form. Without a GPU they
run under Triton's interpreter at small shapes (TRITON_INTERPRET is set before any kernel
module is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from baton_engine.models.moe import experts_sorted, route, silu_and_mul
from baton_kernels.triton.moe import (
    ALIGN_ONE,
    GEMM_CONFIGS,
    align_pairs,
    expert_gemm,
    expert_gemv,
    fused_experts,
    max_blocks,
    ref_fused_experts,
    route_top_k,
    sum_pairs,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol): the kernel rounds the projection and each pair's output once; the reference not
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}


def _routed(
    num_tokens: int, experts: int, top_k: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, experts, generator=g).to(dtype)
    weights, ids = route(logits, top_k, renormalize=True)
    return weights.to(DEVICE), ids.to(DEVICE)


def _experts(
    experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 100)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    return gate_up.to(DEVICE), down.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_tokens", "experts", "top_k", "renormalize"), [
    (1, 8, 2, True), (5, 60, 4, False), (33, 128, 8, True), (3, 6, 6, True), (2, 300, 3, False),
])  # fmt: skip
def test_the_router_picks_what_route_picks(
    dtype: torch.dtype, num_tokens: int, experts: int, top_k: int, renormalize: bool
) -> None:
    """``route_top_k``'s one launch chooses experts of the probabilities ``route`` chooses, in
    the same order, with the same weights (softmax in float32, renormalized or not), from a
    strided view. (Logits in 16 bits tie often: which of equal experts comes first is
    ``topk``'s choice, the lower id the kernel's.)"""
    g = torch.Generator().manual_seed(experts)
    wide = torch.randn(num_tokens, experts + 3, generator=g).to(dtype).to(DEVICE)
    logits = wide[:, 1 : experts + 1]  # (rows strided wider than they are long)
    want_w, want_ids = route(logits, top_k, renormalize)
    got_w, got_ids = route_top_k(logits, top_k, renormalize)
    assert got_ids.dtype == torch.int64 and got_w.dtype == dtype
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert probs.gather(1, got_ids).tolist() == probs.gather(1, want_ids).tolist()
    assert all(len(set(row)) == top_k for row in got_ids.tolist())
    if dtype == torch.float32:  # (no ties)
        assert got_ids.tolist() == want_ids.tolist()
    atol, rtol = {torch.float32: (1e-6, 1e-5)}.get(dtype, TOL[dtype])
    torch.testing.assert_close(got_w, want_w, atol=atol, rtol=rtol)
    if renormalize:
        torch.testing.assert_close(got_w.float().sum(-1), torch.ones(num_tokens, device=DEVICE),
                                   atol=2e-2, rtol=0)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "hidden"), [(1, 8, 2048), (5, 3, 40), (9, 1, 1500)]
)
def test_each_tokens_pairs_are_summed(
    dtype: torch.dtype, num_tokens: int, top_k: int, hidden: int
) -> None:
    """``sum_pairs`` gives torch's ``x.sum(dim=1)`` (float32 accumulation, one rounding)."""
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(num_tokens, top_k, hidden, generator=g).to(dtype).to(DEVICE)
    want = x.sum(dim=1)
    got = sum_pairs(x)
    assert got.dtype == dtype and got.shape == want.shape
    atol, rtol = {torch.float32: (1e-5, 1e-5)}.get(dtype, (1e-2, 8e-3))
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="contiguous"):
        sum_pairs(x[:, :, : hidden - 1])
    # added to a residual in place: what adding the (rounded) sum to it gives
    stream = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(DEVICE)
    want_stream = stream + got
    assert sum_pairs(x, residual=stream, out=stream) is stream
    torch.testing.assert_close(stream, want_stream, atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="residual must be"):
        sum_pairs(x, residual=stream[:, :-1])


def test_the_router_breaks_ties_toward_the_lower_id_and_refuses_bad_input() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]], device=DEVICE)
    weights, ids = route_top_k(logits, 3, renormalize=True)
    assert ids.tolist() == [[1, 2, 4]]
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 3, device=DEVICE))
    with pytest.raises(ValueError, match="cannot choose 6"):
        route_top_k(logits, 6, renormalize=True)
    with pytest.raises(ValueError, match="cannot choose"):
        route_top_k(logits[0], 2, renormalize=True)
    with pytest.raises(ValueError, match="unsupported dtype"):
        route_top_k(logits.double(), 2, renormalize=True)
    empty_w, empty_ids = route_top_k(logits[:0], 2, renormalize=False)
    assert empty_w.shape == empty_ids.shape == (0, 2)


@pytest.mark.parametrize(("num_tokens", "experts", "top_k", "block_m"), [
    (1, 8, 2, 16), (7, 6, 3, 16), (40, 8, 2, 16), (70, 60, 8, 32), (300, 5, 1, 64),
    (64, 128, 8, 16),  # (Qwen3-30B-A3B's experts at a decode step of 64)
    (1100, 16, 4, 32),  # (beyond ALIGN_ONE pairs: several programs count, then place)
])  # fmt: skip
def test_pairs_are_grouped_by_expert_in_blocks(
    num_tokens: int, experts: int, top_k: int, block_m: int
) -> None:
    """Every pair lands in exactly one block row, each block holds one expert's pairs (in
    their order when several programs place them), an expert's blocks are full but its last,
    and no block follows the last."""
    _, ids = _routed(num_tokens, experts, top_k, seed=num_tokens)
    align = align_pairs(ids, experts, block_m)
    num_pairs = ids.numel()
    blocks = max_blocks(num_pairs, experts, block_m)
    assert align.block_expert.shape == (blocks,) and align.pairs.shape == (blocks * block_m,)
    flat = ids.reshape(-1).tolist()
    owners, rows = align.block_expert.tolist(), align.block_rows.tolist()
    pairs = align.pairs.view(blocks, block_m).tolist()
    used = [b for b in range(blocks) if owners[b] >= 0]
    assert used == list(range(len(used)))  # the blocks in use come first
    assert all(rows[b] == 0 for b in range(len(used), blocks))
    assert [owners[b] for b in used] == sorted(owners[b] for b in used)
    for expert in range(experts):
        mine = [p for b in used if owners[b] == expert for p in pairs[b][: rows[b]]]
        if num_pairs <= ALIGN_ONE:  # (one program's atomic cursors: the hardware's order)
            mine.sort()
        assert mine == [p for p, e in enumerate(flat) if e == expert]
        expert_rows = [rows[b] for b in used if owners[b] == expert]
        assert all(r == block_m for r in expert_rows[:-1]) and all(r > 0 for r in expert_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_tokens", "experts", "top_k", "hidden", "inter", "form"), [
    (1, 8, 2, 64, 48, "grouped"), (5, 6, 1, 64, 40, "grouped"), (33, 8, 4, 96, 48, "grouped"),
    (150, 16, 2, 32, 24, "grouped"),
    (1, 8, 2, 64, 48, "gemv"), (5, 6, 1, 64, 40, "gemv"), (4, 16, 8, 64, 48, "gemv"),
])  # fmt: skip
def test_fused_experts_match_the_reference(
    dtype: torch.dtype,
    num_tokens: int,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    form: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both forms at every size: the grouped GEMMs over aligned blocks (given the activation)
    and the GEMVs a pair (a lone request's: SiLU-and-multiply inside the down projection)."""
    from baton_kernels.triton import moe

    monkeypatch.setattr(moe, "GEMV_TOKENS", 10**6 if form == "gemv" else 0)
    weights, ids = _routed(num_tokens, experts, top_k, seed=num_tokens, dtype=dtype)
    gate_up, down = _experts(experts, hidden, inter, dtype, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = x.to(DEVICE)
    got = fused_experts(x, ids, weights, gate_up, down, None if form == "gemv" else silu_and_mul)
    want = ref_fused_experts(x, ids, weights, gate_up, down, silu_and_mul)
    assert want.abs().max() > 0.5  # (not a sum of nothing)
    # The kernels round the projection to the dtype before the activation, as the model in
    # that dtype does; the reference does not. That rounding moves an output by up to ~1% of
    # the output's scale in bf16 (0.043 at an element of 5 tokens x 6 experts, scale 7.5, on
    # the H100 and H200, and in a round-to-nearest emulation on the CPU), so the tolerance
    # is the dtype's at that scale; a wrong expert or weight moves it by the scale itself.
    atol, rtol = TOL[dtype]
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got, want, atol=atol * scale, rtol=rtol)
    # and what the engine's eager form (one GEMM pair an expert) gives, which rounds the
    # activation's product too (and cuBLAS may reduce in bf16)
    sorted_form = experts_sorted(x, ids, weights, gate_up, down)
    torch.testing.assert_close(got, sorted_form, atol=2 * atol * scale, rtol=2 * rtol)


def test_experts_no_pair_chose_are_never_read() -> None:
    """NaN in every expert but the two chosen: the output stays finite and exact."""
    experts, hidden, inter = 8, 64, 32
    gate_up, down = _experts(experts, hidden, inter, torch.float32)
    ids = torch.tensor([[2, 5], [5, 2], [2, 5]], device=DEVICE)
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]], device=DEVICE)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    want = ref_fused_experts(x, ids, weights, gate_up, down, silu_and_mul)
    for e in range(experts):
        if e not in (2, 5):
            gate_up[e] = float("nan")
            down[e] = float("nan")
    got = fused_experts(x, ids, weights, gate_up, down, silu_and_mul)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_each_pair_gets_its_own_row_scaled_by_its_weight() -> None:
    """``expert_gemm`` alone: pair p's row is ``a[p // k] @ w[expert].T`` times its weight,
    whatever block it was grouped into."""
    experts, k_in, n_out, top_k = 4, 48, 40, 2
    _, ids = _routed(9, experts, top_k, seed=4)
    w = torch.randn(experts, n_out, k_in, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    a = torch.randn(9, k_in, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    route_w = torch.rand(18, generator=torch.Generator().manual_seed(7)).to(DEVICE) + 0.5
    align = align_pairs(ids, experts, 16)
    got = expert_gemm(a, w, align, 18, top_k=top_k, route=route_w, config=(16, 32, 16, 4, 2))
    flat = ids.reshape(-1)
    want = torch.stack([route_w[p] * (a[p // top_k] @ w[flat[p]].t()) for p in range(18)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    mine = expert_gemm(got, w[:, :, :n_out], align, 18, config=(16, 32, 16, 4, 2))
    want_own = torch.stack([got[p] @ w[flat[p], :, :n_out].t() for p in range(18)])
    torch.testing.assert_close(mine, want_own, atol=1e-4, rtol=1e-5)


def test_a_few_pairs_run_as_gemvs_without_alignment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``expert_gemv`` alone: pair p's row is ``a[p // k] @ w[expert].T`` (times its weight),
    and with ``silu_mul`` its own row's SiLU(gate) * up, rounded, times its expert's down
    weight; ``fused_experts`` up to ``GEMV_TOKENS`` tokens never aligns the pairs, and two
    pairs of one expert each get their own row."""
    from baton_kernels.triton import moe

    experts, k_in, n_out, top_k = 4, 48, 40, 3
    ids = torch.tensor([[2, 0, 3], [3, 2, 1]], device=DEVICE)  # (experts 2 and 3 twice)
    w = torch.randn(experts, n_out, k_in, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    a = torch.randn(2, k_in, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    route_w = torch.rand(6, generator=torch.Generator().manual_seed(7)).to(DEVICE) + 0.5
    got = expert_gemv(a, w, ids, top_k=top_k, route=route_w, config=(16, 16, 4, 2))
    flat = ids.reshape(-1)
    want = torch.stack([route_w[p] * (a[p // top_k] @ w[flat[p]].t()) for p in range(6)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    gu = torch.randn(6, 2 * n_out, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    down = w[:, :, :n_out].contiguous()
    mine = expert_gemv(gu, down, ids, silu_mul=True)
    act = silu_and_mul(gu)
    want_own = torch.stack([act[p] @ down[flat[p]].t() for p in range(6)])
    torch.testing.assert_close(mine, want_own, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        expert_gemv(gu[:, :-1], down, ids, silu_mul=True)
    with pytest.raises(ValueError, match="rows for 6 pairs"):
        expert_gemv(a, w, ids)
    with pytest.raises(ValueError, match="route must be"):
        expert_gemv(a, w, ids, top_k=top_k, route=route_w[:5])

    def no_alignment(*args: object) -> None:
        raise AssertionError("aligned")

    monkeypatch.setattr(moe, "align_pairs", no_alignment)
    gate_up, down = _experts(experts, 32, 16, torch.float32)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    got = fused_experts(x, ids, route_w.view(2, 3), gate_up, down)
    want = ref_fused_experts(x, ids, route_w.view(2, 3), gate_up, down, silu_and_mul)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused() -> None:
    gate_up, down = _experts(4, 32, 16, torch.float32)
    weights, ids = _routed(3, 4, 2)
    x = torch.randn(3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="do not match"):
        fused_experts(x[:2], ids, weights, gate_up, down, silu_and_mul)
    with pytest.raises(ValueError, match="does not fit"):
        fused_experts(x[:, :16], ids, weights, gate_up, down, silu_and_mul)
    with pytest.raises(ValueError, match="integers"):
        align_pairs(ids.float(), 4, 16)
    with pytest.raises(ValueError, match="power of two"):
        align_pairs(ids, 4, 24)
    align = align_pairs(ids, 4, 16)
    with pytest.raises(ValueError, match="blocks have 16 rows"):
        expert_gemm(x, gate_up, align, 6, top_k=2, config=(32, 32, 32, 4, 2))


def test_the_kernels_compile_for_hopper() -> None:
    """What the interpreter runs, Triton's compiler must accept too: every variant compiled for
    sm_90 without a GPU (the ptxas of Triton's package), each within an SM's shared memory
    (``benchmarks/moe_kernels_sm90.py``, in a process without the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parents[2] / "benchmarks" / "moe_kernels_sm90.py"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # the router's 2, the sum's 2, the alignment's 12 (3 numbers of experts), each tile in
    # bf16 for both projections, the first in f32 for both, the GEMV's 2 (both projections)
    assert done.stdout.count("shared") == 2 + 2 + 12 + 2 * len(GEMM_CONFIGS) + 2 + 2
