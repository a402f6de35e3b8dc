"""BlockPool: fixed-size KV blocks with ref counts, an LRU free queue and a prefix-hash index.

Contract:
- Every block is either in use (``ref_cnt > 0``, not in the free queue) or free (``ref_cnt == 0``,
  in the free queue). ``num_free_blocks + num_used_blocks == num_blocks`` always.
- The free queue is in eviction order: the head is evicted first. Freed blocks go to the tail, so
  the least recently freed block is reused first. Callers free a request's blocks in reverse order,
  so the tail of a prefix chain is evicted before its head.
- The free queue is a doubly linked list through the blocks themselves (as vLLM's
  ``FreeKVCacheBlockQueue``): every operation is O(1) a block, and none is ever O(pool). (An
  ``OrderedDict`` keyed by block id rebuilt its hash table from time to time as blocks came and
  went: ~30-45 ms for a GPU's pool of ~600k blocks, inside one step's bookkeeping, holding the
  GIL; see benchmarks/bench_block_pool.py.)
- A free block keeps its hash and stays findable by it until it is taken for new data; taking it
  evicts it from the index. A cache hit on a free block takes it out of the free queue.
- Block tables are append-only; blocks are shared by reference counting, never copied.
- ``on_evict``, if set, sees each cached block (the one the index names for its hash) just
  before it is taken for new data: the host tier saves it then (``host_cache``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from baton_engine.kv_cache.hashing import BlockHash


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # neighbours in the pool's free queue while free (ref_cnt == 0), else None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


@dataclass(frozen=True)
class KVCacheEvent:
    """A change to what this pool caches, for the kvstore's prefix index."""

    kind: str  # "stored" | "removed"
    hash_value: bytes


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, enable_kv_events: bool = False
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events  # record events for take_events()
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # The free queue, in eviction order between two sentinels (head first).
        self._head, self._tail = KVCacheBlock(-1), KVCacheBlock(-1)
        chain = [self._head, *self.blocks, self._tail]
        for prev, block in pairwise(chain):
            prev.next_free, block.prev_free = block, prev
        self._num_free = num_blocks
        # hash digest -> the block that holds it
        self._cached: dict[bytes, KVCacheBlock] = {}
        self._events: list[KVCacheEvent] = []
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def usage(self) -> float:
        return 1.0 - self._num_free / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        return [b.block_id for b in self._free_queue()]

    def _free_queue(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None, "the free queue is broken"
            yield block
            block = block.next_free

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        block = self._cached.get(block_hash.hash_value)
        if block is None or block.block_hash is None:
            return None
        # Equal digests with different tokens would be a collision: never share then.
        return block if block.block_hash.token_ids == block_hash.token_ids else None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting their cached hashes."""
        if num_blocks > self._num_free:
            raise ValueError(f"asked for {num_blocks} blocks, {self._num_free} free")
        taken = []
        block = self._head.next_free
        for _ in range(num_blocks):
            assert block is not None
            if block.block_hash is not None:
                if (
                    self.on_evict is not None
                    and self._cached.get(block.block_hash.hash_value) is block
                ):
                    self.on_evict(block)
                self._evict(block)
            block.ref_cnt = 1
            block.prev_free = None
            taken.append(block)
            nxt, block.next_free = block.next_free, None
            block = nxt
        assert block is not None
        self._head.next_free, block.prev_free = block, self._head
        self._num_free -= num_blocks
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a prefix-cache hit), reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                prev, nxt = block.prev_free, block.next_free
                assert prev is not None and nxt is not None, f"{block} is not in the free queue"
                prev.next_free, nxt.prev_free = nxt, prev
                block.prev_free = block.next_free = None
                self._num_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free-queue tail."""
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        freed = 0
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                last.next_free, block.prev_free = block, last
                last = block
                freed += 1
        last.next_free, tail.prev_free = tail, last
        self._num_free += freed

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
    ) -> None:
        """Index ``blocks[start:end]`` under ``block_hashes[start:end]`` (they are full)."""
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end], strict=True):
            if block.block_hash is not None:
                continue  # already cached (a prefix hit, or cached in an earlier step)
            block.block_hash = block_hash
            if block_hash.hash_value not in self._cached:
                self._cached[block_hash.hash_value] = block
                if self.enable_kv_events:
                    self._events.append(KVCacheEvent("stored", block_hash.hash_value))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self._num_free != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def cached_digests(self) -> Collection[bytes]:
        """A live view of the cached digests (for membership tests on the engine's thread)."""
        return self._cached.keys()

    def cached_hashes(self) -> list[bytes]:
        """The digests of every cached block (a snapshot; safe to call from another thread)."""
        return list(self._cached)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        digest = block.block_hash.hash_value
        if self._cached.get(digest) is block:
            del self._cached[digest]
            if self.enable_kv_events:
                self._events.append(KVCacheEvent("removed", digest))
        block.block_hash = None

    def check_referenced(self, refs: dict[int, int]) -> None:
        """The check of the blocks in use only, in O(len(refs)): each block of ``refs`` (block
        id -> number of holders) has that ref count and is not free, and free + used == total,
        so no block leaked (every other block is free). Raise AssertionError otherwise."""
        for block_id, count in refs.items():
            block = self.blocks[block_id]
            assert block.ref_cnt == count, f"{block}: ref count != number of holders ({count})"
            assert block.prev_free is None and block.next_free is None, f"{block} is held but free"
        assert self._num_free + len(refs) == self.num_blocks, (
            f"{self.num_blocks - self._num_free} blocks in use but {len(refs)} held: a leak"
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (O(pool size))."""
        queued = set()
        prev = self._head
        for block in self._free_queue():
            assert block.prev_free is prev, f"{block}'s back link is broken"
            assert id(block) not in queued, f"{block} is in the free queue twice"
            queued.add(id(block))
            prev = block
        assert self._tail.prev_free is prev, "the free queue's tail link is broken"
        assert len(queued) == self._num_free, f"{len(queued)} queued, {self._num_free} counted"
        for block in self.blocks:
            in_free = id(block) in queued
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            assert in_free == (block.ref_cnt == 0), f"{block} free={in_free} ref={block.ref_cnt}"
            if not in_free:
                assert block.prev_free is None and block.next_free is None, f"{block} links"
        for digest, block in self._cached.items():
            assert block.block_hash is not None and block.block_hash.hash_value == digest, (
                f"index entry {digest.hex()} points at {block} with another hash"
            )
