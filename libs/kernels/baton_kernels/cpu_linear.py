"""Linear layers with weights packed once at load time (CPU, bfloat16).

Two kernels, chosen per machine:

- ``vnni``: the C++ AVX512-BF16 GEMM (``csrc/gemm_bf16_cpu.cpp``) over a weight packed by
  ``pack_vnni``. Where the CPU has AVX512-BF16 it is used for every row count: on the 2-core
  AVX-512 development machine one decode step's linear layers (SmolLM2, 16 requests) take ~13 ms
  against oneDNN's ~22 ms, 1 request ~7 against ~16 ms, and prompt-sized GEMMs run at oneDNN's
  speed (benchmarks/RESULTS.md). On CPUs with AMX the same packed weight feeds the tile unit
  (K a multiple of 32): on a 2-core AMX VM the 16-request step's layers ~14 ms against ~23 for
  oneDNN (there on AMX too) and ~29 for AVX512-BF16; 512 rows at oneDNN's speed, 2,048 rows
  ~1.2x its time.
- ``onednn``: oneDNN's own blocked layout (``torch.ops.mkldnn``); plain ``F.linear`` would reorder
  the weight on every call.

``ref``: ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from baton_kernels.cpu_ops import load_cpu_ops


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N/16), ceil(K/2), 16, 2]``: blocks of 16 output columns, each holding
    pairs of consecutive K values side by side (the operand layout of AVX512-BF16's VDPBF16PS);
    padding is zero."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 16) * 16, -(-k // 2) * 2, dtype=weight.dtype)
    padded[:n, :k] = weight
    blocks = padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 2, 2)
    return blocks.permute(0, 2, 1, 3).contiguous()


def vnni_ops() -> Any | None:
    """The C++ module when its AVX512-BF16 GEMM was built for this CPU, else None."""
    ops = load_cpu_ops()
    return ops if ops is not None and ops.bf16_gemm_available() else None


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: it needs AVX512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and says so only when asked to (an AVX2-only CPU raises), so ask once."""
    if not (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and (vnni_ops() is not None or onednn_bf16_available())
    )


class PackedLinear(nn.Module):
    """Inference-only replacement for ``nn.Linear`` holding a packed weight; ``kernel`` is
    ``"vnni"`` or ``"onednn"`` (default: ``vnni`` where the CPU has it). ``out_float32``: the
    ``vnni`` kernel returns its float32 sums unrounded (for the LM head: bf16 logits of a 49k
    vocabulary tie often enough to flip greedy answers); ``onednn`` always returns bf16."""

    packed_weight: torch.Tensor  # a buffer: [ceil(N/16), ceil(K/2), 16, 2] (vnni) or oneDNN's

    def __init__(
        self, linear: nn.Linear, kernel: str | None = None, out_float32: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_float32 = out_float32
        self._ops = vnni_ops() if kernel in (None, "vnni") else None
        if kernel == "vnni" and self._ops is None:
            raise RuntimeError("the AVX512-BF16 GEMM is not available on this CPU")
        self.kernel = "vnni" if self._ops is not None else "onednn"
        with torch.no_grad():
            weight = linear.weight.detach()
            if self._ops is not None:
                packed = pack_vnni(weight)
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self._ops is not None:
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            bias = None if self.bias is None else self.bias.detach()
            out = self._ops.linear_bf16_vnni(
                rows, self.packed_weight, bias, self.out_features, self.out_float32
            )
        else:
            out = torch.ops.mkldnn._linear_pointwise(
                rows, self.packed_weight, self.bias, "none", [], ""
            )
        return out.view(*shape[:-1], self.out_features)  # type: ignore[no-any-return]


def pack_linears(module: nn.Module, float32_outputs: tuple[str, ...] = ()) -> dict[str, int]:
    """Replace every packable ``nn.Linear`` under ``module`` in place; return how many per
    kernel. Children named in ``float32_outputs`` (e.g. ``"lm_head"``) return float32."""
    counts: dict[str, int] = {}
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_pack(child.weight):
            packed = PackedLinear(child, out_float32=name in float32_outputs)
            setattr(module, name, packed)
            counts[packed.kernel] = counts.get(packed.kernel, 0) + 1
        else:
            for kernel, num in pack_linears(child, float32_outputs).items():
                counts[kernel] = counts.get(kernel, 0) + num
    return counts
