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


def create_attention_backend(name: str) -> AttentionBackend:
    _load_builtin()
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {sorted(_REGISTRY)}"
        ) from None


def _load_builtin() -> None:
    if "torch" not in _REGISTRY:
        from baton_kernels.attention.torch_backend import TorchAttentionBackend

        register_backend("torch", TorchAttentionBackend)
