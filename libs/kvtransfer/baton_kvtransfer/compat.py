"""The compatibility hash: two engines may exchange KV blocks only if theirs are equal."""

from __future__ import annotations

import hashlib
import json

COMPAT_HASH_BYTES = 16
_VERSION = "baton-kv-v1"  # bump when the meaning of a block's bytes changes


def compat_hash(
    model: str, dtype: str, block_size: int, layout: str, **extra: str | int | float | bool
) -> bytes:
    """16-byte blake2b over a canonical (sorted-key JSON) encoding of everything that decides
    what a block's bytes mean: the model (name or weights digest), the KV dtype, tokens per
    block, the pool layout (e.g. ``"blocks,layers,kv,block_size,kv_heads,head_dim"``) and any
    ``extra`` fields (e.g. ``num_layers=24``, ``kv_heads=2``, ``head_dim=64``)."""
    fields: dict[str, str | int | float | bool] = {
        "model": model,
        "dtype": dtype,
        "block_size": block_size,
        "layout": layout,
    }
    fields.update(extra)  # a name given twice is already a TypeError at the call
    canonical = json.dumps([_VERSION, fields], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=COMPAT_HASH_BYTES).digest()
