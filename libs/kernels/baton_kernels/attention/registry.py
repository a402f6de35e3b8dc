"""Attention backend registry: name -> factory, plus what each backend runs on.

    torch       plain PyTorch, any device (the reference)
    cpu         the reference with a C++ paged decode kernel (CPU)
    triton      Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1, for tests)
    flash_attn  flash-attn 2 varlen with a block table (CUDA, when ``flash_attn`` imports)
    flashinfer  FlashInfer paged prefill (CUDA, when ``flashinfer`` imports)

"auto" picks triton on CUDA and cpu on CPU, falling back to torch where the pick cannot run the
dtype, head size or KV cache dtype (an 8-bit cache: torch and triton read one);
``BATON_ATTENTION_BACKEND`` replaces "auto" with a name, and an explicit name in the config wins
over both.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton_kernels.attention.base import FP8_KV_DTYPES, AttentionBackend

logger = logging.getLogger(__name__)

ENV_VAR = "BATON_ATTENTION_BACKEND"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BackendSpec:
    name: str
    factory: Callable[[], AttentionBackend]
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    head_sizes: tuple[int, ...] | None = None  # None: any
    requires: str | None = None  # a module that must import
    interpreted_on_cpu: bool = False  # also runs on CPU under TRITON_INTERPRET=1 (tests)
    kv_dtypes: tuple[torch.dtype, ...] = ()  # caches it reads besides the model's dtype

    def why_unsupported(
        self,
        device: str,
        dtype: torch.dtype | None,
        head_dim: int | None,
        kv_dtype: torch.dtype | None = None,
    ) -> str | None:
        """None when this backend can run the combination; else the reason."""
        devices = self.devices
        if self.interpreted_on_cpu and os.environ.get("TRITON_INTERPRET") == "1":
            devices = (*devices, "cpu")
        if device not in devices:
            return f"it runs on {'/'.join(devices)}, not {device}"
        if dtype is not None and dtype not in self.dtypes:
            return f"it does not support {dtype}"
        if head_dim is not None and self.head_sizes is not None and head_dim not in self.head_sizes:
            return f"it supports head sizes {list(self.head_sizes)}, not {head_dim}"
        if kv_dtype is not None and kv_dtype != dtype and kv_dtype not in self.kv_dtypes:
            return f"it does not read a KV cache of {kv_dtype}"
        if self.requires is not None:
            try:
                importlib.import_module(self.requires)
            except Exception as e:  # ImportError, or a broken install failing on load
                return f"the {self.requires!r} package does not import ({e})"
        return None


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(
    name: str,
    factory: Callable[[], AttentionBackend],
    *,
    devices: tuple[str, ...] = ("cpu", "cuda"),
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    head_sizes: tuple[int, ...] | None = None,
    requires: str | None = None,
    interpreted_on_cpu: bool = False,
    kv_dtypes: tuple[torch.dtype, ...] = (),
) -> None:
    _REGISTRY[name] = BackendSpec(
        name, factory, devices, dtypes, head_sizes, requires, interpreted_on_cpu, kv_dtypes
    )


def available_backends() -> list[str]:
    """Every registered name, whether or not its package imports here."""
    _load_builtin()
    return sorted(_REGISTRY)


def create_attention_backend(
    name: str = "auto",
    device: str = "cpu",
    *,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend called ``name`` (or the one "auto" picks) for a model of ``dtype`` and
    ``head_dim`` on ``device`` ("cpu" / "cuda"), its KV cache of ``kv_dtype`` (None: the
    model's). An unknown name, or a backend that cannot run this combination, is a ValueError
    that says why."""
    _load_builtin()
    if name == "auto":
        name = os.environ.get(ENV_VAR) or _auto(device, dtype, head_dim, kv_dtype)
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(
            f"unknown attention backend {name!r}; valid: {['auto', *sorted(_REGISTRY)]}"
        )
    reason = spec.why_unsupported(device, dtype, head_dim, kv_dtype)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot be used: {reason}")
    return spec.factory()


def _auto(
    device: str, dtype: torch.dtype | None, head_dim: int | None, kv_dtype: torch.dtype | None
) -> str:
    if device == "cuda" and torch.cuda.is_available():
        reason = _REGISTRY["triton"].why_unsupported(device, dtype, head_dim, kv_dtype)
        if reason is None:
            return "triton"
        logger.warning("attention backend triton unavailable (%s); using torch", reason)
        return "torch"
    if device == "cpu" and _REGISTRY["cpu"].why_unsupported(device, dtype, None, kv_dtype) is None:
        from baton_kernels.cpu_ops import load_cpu_ops

        if load_cpu_ops() is not None:
            return "cpu"
    return "torch"


def _load_builtin() -> None:
    if "torch" in _REGISTRY:
        return
    from baton_kernels.attention.torch_backend import TorchAttentionBackend

    register_backend("torch", TorchAttentionBackend, kv_dtypes=FP8_KV_DTYPES)
    register_backend("cpu", _create_cpu_backend, devices=("cpu",), kv_dtypes=FP8_KV_DTYPES)
    register_backend(
        "triton",
        _create_triton_backend,
        devices=("cuda",),
        requires="triton",
        interpreted_on_cpu=True,
        kv_dtypes=FP8_KV_DTYPES,
    )
    register_backend(
        "flash_attn",
        _create_flash_attn_backend,
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        head_sizes=(64, 96, 128, 256),
        requires="flash_attn",
    )
    register_backend(
        "flashinfer",
        _create_flashinfer_backend,
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        head_sizes=(64, 128, 256),
        requires="flashinfer",
    )


def _create_cpu_backend() -> AttentionBackend:
    from baton_kernels.attention.cpu_backend import CpuAttentionBackend
    from baton_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        raise ValueError("the cpu attention backend needs a C++ compiler and ninja to build")
    return CpuAttentionBackend(ops)


def _create_triton_backend() -> AttentionBackend:
    from baton_kernels.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _create_flash_attn_backend() -> AttentionBackend:
    from baton_kernels.attention.external_backends import FlashAttnBackend

    return FlashAttnBackend()


def _create_flashinfer_backend() -> AttentionBackend:
    from baton_kernels.attention.external_backends import FlashInferBackend

    return FlashInferBackend()
