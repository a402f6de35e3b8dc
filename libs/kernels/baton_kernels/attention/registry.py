"""Attention backend registry: name -> factory."""

from __future__ import annotations

from collections.abc import Callable

from baton_kernels.attention.base import AttentionBackend

_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def create_attention_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """``name`` from the registry, or "auto": the C++ CPU kernel on CPU when it builds, else the
    PyTorch reference."""
    _load_builtin()
    if name == "auto":
        from baton_kernels.cpu_ops import load_cpu_ops

        name = "cpu" if device == "cpu" and load_cpu_ops() is not None else "torch"
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {['auto', *sorted(_REGISTRY)]}"
        ) from None


def _load_builtin() -> None:
    if "torch" not in _REGISTRY:
        from baton_kernels.attention.torch_backend import TorchAttentionBackend

        register_backend("torch", TorchAttentionBackend)
        register_backend("cpu", _create_cpu_backend)


def _create_cpu_backend() -> AttentionBackend:
    from baton_kernels.attention.cpu_backend import CpuAttentionBackend
    from baton_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        raise ValueError("the cpu attention backend needs a C++ compiler and ninja to build")
    return CpuAttentionBackend(ops)
