"""The sparse MLP of a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE), as transformers
computes it: a router (``gate``) scores the experts for each token; the token goes to its
``top_k`` best by softmax probability (renormalized to sum to 1 where the model says so), and
its output is the sum of those experts' SwiGLU MLPs weighted by the probabilities. Qwen2-MoE
adds a shared expert that every token goes through, scaled by a sigmoid gate.

The experts' weights are stacked, as transformers >= 5 holds them: ``experts.gate_up_proj``
``[E, 2I, H]`` (gate rows, then up rows) and ``experts.down_proj`` ``[E, H, I]``; checkpoints
with one tensor an expert are stacked at load time (``Experts.load``). With tensor
parallelism each rank holds every expert's share of ``I`` (gate/up by rows, down by columns),
as for a dense MLP, and the layer's all-reduce sums the partial outputs; the router and the
shared expert's gate are replicated.

On a GPU with the Triton backend (``SparseMoE.triton_experts``), every step runs the experts
as grouped GEMMs over the token-expert pairs (``baton_kernels.triton.moe``): each chosen
expert's weights read once, no host work, so decode steps and prompt-step pieces are captured
in CUDA graphs. Elsewhere (the CPU, the torch reference backend), three ways to run the
experts, with the same result (``experts_sorted`` is the reference):
- ``experts_sorted``: the token-expert pairs sorted by expert, one GEMM pair an expert that
  has tokens. It reads the routing on the host (how many tokens each expert has), so it cannot
  be captured in a CUDA graph; it runs every step but the captured decode steps.
- ``experts_gathered``: each pair's expert weights gathered (copied), then batched GEMVs: it
  reads only the experts chosen, twice (the copy).
- ``experts_dense``: every expert on every token, weighted by a routing matrix that is zero
  where a token did not choose the expert: three launches, every expert's weights read once.
The last two are what a captured decode step runs without the Triton experts (static shapes,
no host work): the gather while the pairs are at most half the experts (``2 T k <= E``: it
moves fewer bytes), the dense form beyond, where a decode step reads most experts' weights
anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton_engine.config import ModelConfig
from baton_kernels import fused

Activation = Callable[[torch.Tensor], torch.Tensor]
# GPUs with the fused kernels on run the experts as Triton's grouped GEMMs
# (``baton_kernels.triton.moe``, ``SparseMoE.triton_experts``) at every step; False: the three
# forms below (an A/B switch for benchmarks/device/moe51.sh).
TRITON_EXPERTS = True


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dimension times its second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for each token, from its logits ``[T, E]``: ``(weights, ids)``,
    both ``[T, top_k]``, the weights in the logits' dtype (softmax in float32, as
    transformers)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def experts_sorted(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Activation = silu_and_mul,
) -> torch.Tensor:
    """The experts' weighted sum for each token of ``x`` ``[T, H]`` routed to ``ids`` with
    ``weights`` (``[T, k]``): ``[T, H]``. Each token's outputs are summed in expert order, as
    transformers sums them."""

    def mlp(rows: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(act(F.linear(rows, gate_up[expert])), down[expert])

    return by_expert(x, ids, weights, gate_up.shape[0], mlp)


def by_expert(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    mlp: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """``experts_sorted`` with each expert's MLP given as ``mlp(rows, expert)``."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # (the host sync)
    token = order // top_k
    rows = x.index_select(0, token)
    out = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            end = start + n
            out[start:end] = mlp(rows[start:end], expert)
            start = end
    out.mul_(weights.flatten()[order].unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, token, out)


def experts_gathered(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Activation = silu_and_mul,
) -> torch.Tensor:
    """``experts_sorted`` with each token-expert pair's weights gathered (static shapes)."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()
    rows = x.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, x.shape[1], 1)  # [T k, H, 1]
    hidden = act(torch.bmm(gate_up.index_select(0, flat), rows).squeeze(2))  # [T k, I]
    out = torch.bmm(down.index_select(0, flat), hidden.unsqueeze(2)).squeeze(2)  # [T k, H]
    out = out * weights.reshape(-1, 1)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def experts_dense(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Activation = silu_and_mul,
) -> torch.Tensor:
    """``experts_sorted`` with every expert run on every token (static shapes)."""
    num_experts = gate_up.shape[0]
    routing = torch.zeros(x.shape[0], num_experts, dtype=x.dtype, device=x.device)
    routing.scatter_(1, ids, weights)  # [T, E]: zero where a token did not choose the expert
    hidden = torch.matmul(x, gate_up.transpose(1, 2))  # [E, T, 2I]
    hidden = act(hidden.flatten(0, 1)).view(num_experts, x.shape[0], -1)
    out = torch.bmm(hidden, down.transpose(1, 2))  # [E, T, H]
    return torch.einsum("te,eth->th", routing, out)


class Experts(nn.Module):
    """The stacked weights of a layer's experts (one rank's share of each)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # (the C++ module, each expert's gate_up and down) once packed for the CPU's GEMM
        self._packed: tuple[Any, list[torch.Tensor], list[torch.Tensor]] | None = None

    def pack(self) -> bool:
        """Pack each expert's weights for the CPU's AVX512-BF16 GEMM (bf16 on a CPU that has
        it; as ``cpu_linear.PackedLinear`` packs a linear layer): up to 3x faster than
        ``F.linear`` for the few rows an expert gets. The stacked weights are dropped (nothing
        reads them after); call after the weights are final. Returns whether they are packed."""
        from baton_kernels.cpu_linear import can_pack, pack_vnni, vnni_ops

        ops = vnni_ops()
        if ops is None or not can_pack(self.gate_up_proj):
            return False
        with torch.no_grad():
            gate_up = [pack_vnni(w) for w in self.gate_up_proj.detach()]
            down = [pack_vnni(w) for w in self.down_proj.detach()]
            self.gate_up_proj.data = self.gate_up_proj.data.new_empty(0)
            self.down_proj.data = self.down_proj.data.new_empty(0)
        self._packed = (ops, gate_up, down)
        return True

    def sorted(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: Activation
    ) -> torch.Tensor:
        """``experts_sorted`` of these experts (on their packed weights once ``pack``-ed)."""
        if self._packed is None:
            return experts_sorted(x, ids, weights, self.gate_up_proj, self.down_proj, act)
        ops, gate_up, down = self._packed
        width, hidden = 2 * self.intermediate_size, self.hidden_size

        def mlp(rows: torch.Tensor, expert: int) -> torch.Tensor:
            h = ops.linear_bf16_vnni(rows, gate_up[expert], None, width, False)
            return ops.linear_bf16_vnni(act(h), down[expert], None, hidden, False)  # type: ignore[no-any-return]

        return by_expert(x, ids, weights, self.num_experts, mlp)

    def load(self, expert: int, part: str, tensor: torch.Tensor) -> str:
        """Copy one expert's ``gate_proj``, ``up_proj`` or ``down_proj`` weight (this rank's
        share) in; returns the name of the parameter it went to."""
        size = self.intermediate_size
        with torch.no_grad():
            if part == "down_proj":
                self.down_proj[expert].copy_(tensor)
                return "down_proj"
            start = 0 if part == "gate_proj" else size
            self.gate_up_proj[expert, start : start + size].copy_(tensor)
        return "gate_up_proj"


class SparseMoE(nn.Module):
    """A mixture of experts in place of a decoder layer's MLP (the module docstring)."""

    fused = False  # SiLU-and-multiply as a fused kernel (set by use_fused_kernels)
    triton_experts = False  # the experts as Triton's grouped GEMMs (use_triton_experts)

    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            nn.Linear(cfg.hidden_size, 1, bias=False) if shared_expert is not None else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = fused.silu_and_mul if self.fused else silu_and_mul
        experts = self.experts
        logits = self.gate(x)
        if self.triton_experts:
            from baton_kernels.triton.moe import fused_experts, route_top_k

            weights, ids = route_top_k(logits, self.top_k, self.renormalize)
            out = fused_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj,
                                None if self.fused else act)  # fmt: skip
        else:
            weights, ids = route(logits, self.top_k, self.renormalize)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                few = 2 * ids.numel() <= experts.num_experts
                run = experts_gathered if few else experts_dense
                out = run(x, ids, weights, experts.gate_up_proj, experts.down_proj, act)
            else:
                out = experts.sorted(x, ids, weights, act)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def add_rows(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """``stream.add_(self(x))`` for the few rows of a lone request's decode step (the
        layer's GEMV path, ``DecoderLayer.forward_gemv``, one rank): with the Triton experts
        and no shared expert, the router's logits as a GEMV (cuBLAS's GEMM took ~5 us a layer
        at one row on an H100) and the experts' sum added to ``stream`` by the sum's kernel
        (no add launch), with the same roundings."""
        if not self.triton_experts or self.shared_expert is not None:
            return stream.add_(self(x))
        from baton_kernels.triton.gemv import gemv
        from baton_kernels.triton.moe import fused_experts, route_top_k

        weights, ids = route_top_k(gemv(x, self.gate.weight), self.top_k, self.renormalize)
        experts = self.experts
        return fused_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj,
                             None if self.fused else silu_and_mul, residual=stream,
                             out=stream)  # fmt: skip
