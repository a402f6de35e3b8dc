"""The decoder's fused elementwise ops, by device: Triton kernels on GPUs
(``triton/fused_ops.py``), C++ on CPUs (``csrc/fused_ops_cpu.cpp``). Each replaces a chain of
small torch kernels and rounds where that chain rounds (one rounding in fp32 on the GPU); the
model keeps the torch ops as the reference (``LlamaForCausalLM.use_fused_kernels``)."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from baton_kernels.cpu_ops import load_cpu_ops


def available(device: torch.device) -> bool:
    """Whether the fused ops run on ``device`` (Triton importable, or the C++ kernels built)."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    if device.type == "cpu":
        return load_cpu_ops() is not None
    return False


def _cpu() -> Any:
    ops = load_cpu_ops()
    if ops is None:
        raise RuntimeError("the CPU kernels are not built (see baton_kernels.cpu_ops)")
    return ops


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` (``x`` itself when ``residual`` is None), then RMSNorm of the sum:
    ``(normed, residual)``."""
    if x.is_cuda:
        from baton_kernels.triton import fused_ops

        if residual is None:
            return fused_ops.rms_norm(x, weight, eps), x
        return fused_ops.fused_add_rms_norm(x, residual, weight, eps)
    normed, residual = _cpu().fused_add_rms_norm(x, residual, weight, eps)
    return normed, residual


def rotary_embedding_(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    """Rotate ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hk, D]`` in place by each token's
    position, reading ``cos_sin`` ``[max_positions, 2, D]`` (float32)."""
    if query.is_cuda:
        from baton_kernels.triton import fused_ops

        fused_ops.rotary_embedding_(query, key, positions, cos_sin)
    else:
        _cpu().rotary_embedding_(query, key, positions, cos_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[T, 2 * I]``."""
    if x.is_cuda:
        from baton_kernels.triton import fused_ops

        return fused_ops.silu_and_mul(x)
    out: torch.Tensor = _cpu().silu_and_mul(x)
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x[:, :I], approximate="tanh") * x[:, I:]`` for ``x`` ``[T, 2 * I]`` (Gemma's
    GeGLU)."""
    if x.is_cuda:
        from baton_kernels.triton import fused_ops

        return fused_ops.gelu_tanh_and_mul(x)
    out: torch.Tensor = _cpu().gelu_tanh_and_mul(x)
    return out


ARGMAX_TRITON = True  # GPUs' argmax through the Triton kernel (False: torch's)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``[B, V]`` logits: the C++ kernel on CPUs (torch's CPU
    argmax took ~360 us for 16 rows of a 49k vocabulary), the Triton kernel on GPUs (torch's
    took 26 us for one row of 128k on an H200, the kernel 3 us), torch elsewhere."""
    if ARGMAX_TRITON and logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1:
        from baton_kernels.triton import fused_ops

        if logits.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return fused_ops.argmax(logits)
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1:
        ops = load_cpu_ops()
        if ops is not None and logits.dtype in (torch.float32, torch.bfloat16):
            return ops.argmax_rows(logits)  # type: ignore[no-any-return]
    if logits.device.type == "cpu" and logits.dtype != torch.float32:
        logits = logits.float()  # torch's CPU argmax over bf16 is ~3x slower than converting
    return logits.argmax(dim=-1)
