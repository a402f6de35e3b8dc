"""Paged KV cache bookkeeping: block pool, prefix hashing, per-request block tables."""

from baton_engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from baton_engine.kv_cache.hashing import BlockHash, hash_block_tokens, hash_request_tokens
from baton_engine.kv_cache.manager import KVCacheManager, PrefixMatch

__all__ = [
    "BlockHash",
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixMatch",
    "hash_block_tokens",
    "hash_request_tokens",
]
