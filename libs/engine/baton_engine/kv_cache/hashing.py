"""Chained block hashes for prefix caching.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes. Only full blocks are hashed. A request with a LoRA adapter, or a ``cache_salt``, chains
from a root of those (``prefix_root``) instead of the empty one: the same tokens under another
adapter (or none) have other KV, so other hashes; and under another salt (vLLM's, which tenants
set so that no other can learn from a prefix-cache hit what they sent) they share no block.
The token ids are kept with the hash so a hash collision can never hand one request another's
KV. The kvstore's prefix index uses the same hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple


class BlockHash(NamedTuple):
    hash_value: bytes  # 16-byte digest of (parent hash, token ids)
    token_ids: tuple[int, ...]


_ROOT = b"\x00" * 16


_tuple_new = tuple.__new__  # a NamedTuple without its Python-level constructor (per block)
_PACK: dict[int, Callable[..., bytes]] = {}  # token count -> its struct's pack


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    tokens = tuple(token_ids)
    pack = _PACK.get(len(tokens))
    if pack is None:
        pack = _PACK[len(tokens)] = struct.Struct(f"<{len(tokens)}q").pack
    data = (parent.hash_value if parent is not None else _ROOT) + pack(*tokens)
    return _tuple_new(BlockHash, (hashlib.blake2b(data, digest_size=16).digest(), tokens))


def prefix_root(lora_name: str | None, cache_salt: str | None = None) -> BlockHash | None:
    """The parent of a request's first block: None (the empty root) for the base model without
    a salt, else a root of the LoRA adapter's name and the salt."""
    if lora_name is None and cache_salt is None:
        return None
    data = b"" if lora_name is None else b"lora\x00" + lora_name.encode()
    if cache_salt is not None:
        data += b"\x00salt\x00" + cache_salt.encode()
    digest = hashlib.blake2b(data, digest_size=16).digest()
    return _tuple_new(BlockHash, (digest, ()))


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    known: Sequence[BlockHash] = (),
    root: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, extending the already ``known`` prefix;
    ``root``: the first block's parent (``prefix_root``)."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
