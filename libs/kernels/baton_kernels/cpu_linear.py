"""Linear layers with weights pre-packed for oneDNN (CPU, bfloat16).

oneDNN reorders a weight into its blocked layout on every plain ``F.linear`` call; packing once
at load time saves that (about 10% of a decode step's matmul time on a 2-core AVX-512 CPU, see
benchmarks/RESULTS.md). ``ref``: ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """Inference-only replacement for ``nn.Linear`` holding a oneDNN-packed weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, self.in_features), self.packed_weight, self.bias, "none", [], ""
        )
        return out.view(*shape[:-1], self.out_features)  # type: ignore[no-any-return]


def pack_linears(module: nn.Module) -> int:
    """Replace every packable ``nn.Linear`` under ``module`` in place; return how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_pack(child.weight):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
