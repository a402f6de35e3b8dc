"""Attention backends, chosen by name through a registry."""

from baton_kernels.attention.base import AttentionBackend, AttentionMetadata, KVCacheView
from baton_kernels.attention.registry import (
    available_backends,
    create_attention_backend,
    register_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCacheView",
    "available_backends",
    "create_attention_backend",
    "register_backend",
]
