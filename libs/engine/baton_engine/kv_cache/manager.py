"""KVCacheManager: the scheduler's only window onto the KV cache.

It hands out small result types (``PrefixMatch``, lists of new block ids) and keeps block tables
and block hashes per request; the scheduler never touches blocks directly. With a host tier
(``num_host_blocks``, vLLM's ``--kv-offloading-size``) a prefix runs on from the pool's blocks
into the tier's, and the moves between them are queued as ``KVCopy`` entries for the step
(``take_copies``; see ``host_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_engine.kv_cache.block_pool import BlockPool, KVCacheBlock, KVCacheEvent
from baton_engine.kv_cache.hashing import BlockHash, hash_block_tokens, prefix_root
from baton_engine.kv_cache.host_cache import HostBlockCache, KVCopy
from baton_engine.request import Request


@dataclass(frozen=True)
class PrefixMatch:
    num_cached_tokens: int  # of the pool's blocks and the host tier's after them
    blocks: list[KVCacheBlock]  # the pool's
    host_slots: tuple[int, ...] = ()  # the host tier's, copied into new blocks on allocation

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
        num_host_blocks: int = 0,
        num_lookahead_tokens: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        """``num_host_blocks``: slots of the host tier (0: none); it needs prefix caching.
        ``num_lookahead_tokens``: room each allocation leaves after the scheduled tokens, up
        to ``max_model_len`` (a draft model writes its drafts' KV there, ``runner.draft``)."""
        self.block_size = block_size
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, enable_kv_events)
        self._tables: dict[str, list[KVCacheBlock]] = {}  # req_id -> block table (append-only)
        self._hashes: dict[str, list[BlockHash]] = {}  # req_id -> hashes of its full blocks
        self._num_cached_blocks: dict[str, int] = {}  # req_id -> leading table blocks indexed
        self._held: dict[str, list[KVCacheBlock]] = {}  # req_id -> blocks of a prefilled prompt
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found in the pool
        self.num_host_queries = 0  # tokens looked up with a host tier (vLLM's "external")
        self.num_host_hits = 0  # of those, tokens found in the tier
        self.host: HostBlockCache | None = None
        self._copies: list[KVCopy] = []  # for the next step, in the order they must run
        self._protected: tuple[int, ...] = ()  # host slots the allocation under way loads
        if num_host_blocks:
            if not enable_caching:
                raise ValueError("a host KV tier needs prefix caching")
            self.host = HostBlockCache(num_host_blocks, record_drops=enable_kv_events)
            self.pool.on_evict = self._save

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended in place as its tokens grow."""
        known = self._hashes.setdefault(request.req_id, [])
        block_size = self.block_size
        if len(known) < request.num_tokens // block_size:
            # Copy only the unhashed tail: building ``all_token_ids`` each time a block fills
            # would touch every token of the sequence (it dominated the step in which blocks fill).
            start = len(known) * block_size
            prompt = request.prompt_token_ids
            tail = prompt[start:] + request.output_token_ids[max(0, start - len(prompt)) :]
            parent = known[-1] if known else prefix_root(request.lora_name, request.cache_salt)
            for i in range(0, len(tail) - block_size + 1, block_size):
                parent = hash_block_tokens(parent, tail[i : i + block_size])
                known.append(parent)
        return known

    def match_prefix(self, request: Request) -> PrefixMatch:
        """The longest cached prefix of the request, capped so at least one token is computed
        (its logits are needed)."""
        if not self.enable_caching:
            return PrefixMatch(0, [])
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request)[:max_blocks]
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        slots: list[int] = []
        if self.host is not None:
            for block_hash in hashes[len(blocks) :]:
                slot = self.host.lookup(block_hash)
                if slot is None:
                    break
                slots.append(slot)
        return PrefixMatch((len(blocks) + len(slots)) * self.block_size, blocks, tuple(slots))

    def record_prefix_lookup(self, num_tokens: int, prefix: PrefixMatch) -> None:
        """Count one admitted request's prefix lookup (not the retries of a blocked one)."""
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += len(prefix.blocks) * self.block_size
        if self.host is not None:
            self.num_host_queries += num_tokens
            self.num_host_hits += len(prefix.host_slots) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        prefix: PrefixMatch | None = None,
        cache: bool = True,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed (and cached) ones.

        Returns the ids of the blocks appended to the request's table, or None (and changes
        nothing) if the pool cannot supply them. ``cache=False`` leaves the new blocks out of
        the prefix index (their KV arrives later: see ``cache_blocks``).
        """
        if prefix is None:  # the common case, a running request: often nothing to do
            table = self._tables.get(request.req_id)
            if table is not None:
                end = request.num_computed_tokens + num_new_tokens
                if self._room(end) <= len(table) * self.block_size and (
                    not (self.enable_caching and cache)
                    or min(end, request.num_tokens) // self.block_size
                    <= self._num_cached_blocks.get(request.req_id, 0)
                ):
                    request.kv_limit = self._limit(request, len(table)) if cache else 0
                    return []
        table = self._tables.setdefault(request.req_id, [])
        cached = prefix.blocks if prefix is not None else []
        num_computed = request.num_computed_tokens + (prefix.num_cached_tokens if prefix else 0)
        num_needed = cdiv(self._room(num_computed + num_new_tokens), self.block_size)
        num_new_blocks = max(0, num_needed - len(table) - len(cached))
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks or cached:  # else the table already has room (most decode steps)
            num_revived = sum(1 for b in cached if b.ref_cnt == 0)  # hits leaving the free queue
            if num_new_blocks + num_revived > self.pool.num_free_blocks:
                if not table:
                    del self._tables[request.req_id]
                return None
            self.pool.touch(cached)
            table.extend(cached)
            slots = prefix.host_slots if prefix is not None else ()
            self._protected = slots  # (the blocks this takes may be saved over other slots)
            try:
                new_blocks = self.pool.get_new_blocks(num_new_blocks)
            finally:
                self._protected = ()
            table.extend(new_blocks)
            # the host tier's blocks of the prefix into the first new blocks, before any
            # forward pass reads them (a fresh request: its table held only ``cached``)
            loads = zip(new_blocks, slots, strict=False)
            self._copies.extend(KVCopy(False, block.block_id, slot) for block, slot in loads)
        if self.enable_caching and cache:
            # Blocks are indexed once their tokens are known and scheduled: the forward pass writes
            # every scheduled token's KV before any attention reads, so a request admitted later in
            # the same step may already share them.
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            start = self._num_cached_blocks.get(request.req_id, 0)
            if start < num_full:
                hashes = self.block_hashes(request)
                self.pool.cache_full_blocks(table, hashes, start, num_full)
                self._num_cached_blocks[request.req_id] = num_full
        request.kv_limit = self._limit(request, len(table)) if cache else 0
        if not (cached or new_blocks):
            return []
        return [b.block_id for b in cached] + [b.block_id for b in new_blocks]

    def _room(self, end: int) -> int:
        """The tokens an allocation for tokens up to ``end`` makes room for: the lookahead
        after them, within ``max_model_len``."""
        if not self.num_lookahead_tokens:
            return end
        room = end + self.num_lookahead_tokens
        return room if self.max_model_len is None else max(end, min(room, self.max_model_len))

    def _save(self, block: KVCacheBlock) -> None:
        """The pool evicts ``block`` (BlockPool.on_evict): its KV to the host tier first."""
        assert self.host is not None and block.block_hash is not None
        slot = self.host.store(block.block_hash, self._protected)
        if slot is not None:
            self._copies.append(KVCopy(True, block.block_id, slot))

    def take_copies(self) -> list[KVCopy]:
        """The moves between the pool and the host tier queued since the last call, in the
        order the device must run them (before the step's forward pass)."""
        copies, self._copies = self._copies, []
        return copies

    def _limit(self, request: Request, num_blocks: int) -> int:
        """Where the request's computed tokens may end with no call to ``allocate_slots``: in
        its table, and (with caching) short of filling a block not yet indexed, so that the
        step that fills it indexes it. Not while the request runs ahead of its tokens (async
        scheduling): that step's input, the block's last token, is still pending then, and
        the block is indexed by the next step's call, which allocates the next block. Before,
        each block cost two calls in such runs, the first in vain."""
        limit = num_blocks * self.block_size
        if self.num_lookahead_tokens:  # (and the lookahead's room after them)
            limit = max(0, limit - self.num_lookahead_tokens)
        if self.enable_caching and not request.num_pending_tokens:
            num_indexed = self._num_cached_blocks.get(request.req_id, 0)
            limit = min(limit, (num_indexed + 1) * self.block_size - 1)
        return limit

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's full blocks among its first ``num_tokens`` tokens, once their KV
        is in place (after a remote load)."""
        if not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        start = self._num_cached_blocks.get(request.req_id, 0)
        if start < num_full:
            table = self._tables[request.req_id]
            self.pool.cache_full_blocks(table, self.block_hashes(request), start, num_full)
            self._num_cached_blocks[request.req_id] = num_full

    def hold(self, request: Request) -> list[int]:
        """Keep a finished request's blocks (a prefilled prompt, until ``release_held``) and
        drop the rest of its bookkeeping. Returns the held block ids in order."""
        table = self._tables.pop(request.req_id, [])
        self._num_cached_blocks.pop(request.req_id, None)
        self._hashes.pop(request.req_id, None)
        request.kv_limit = 0
        self._held[request.req_id] = table
        return [b.block_id for b in table]

    def release_held(self, req_id: str) -> bool:
        """Free the blocks held for ``req_id``; False if none were held."""
        table = self._held.pop(req_id, None)
        if table is None:
            return False
        self.pool.free_blocks(reversed(table))
        return True

    @property
    def num_held_requests(self) -> int:
        return len(self._held)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so chain tails are evicted first."""
        table = self._tables.pop(request.req_id, [])
        self._num_cached_blocks.pop(request.req_id, None)
        request.kv_limit = 0
        self.pool.free_blocks(reversed(table))

    def forget(self, request: Request) -> None:
        """Drop a finished request's bookkeeping (its hashes)."""
        self.free(request)
        self._hashes.pop(request.req_id, None)

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(req_id, [])]

    def take_events(self) -> list[KVCacheEvent]:
        """What the worker caches changed since the last call, for the kvstore's prefix index:
        a block is removed once neither the pool nor the host tier holds it (a block the pool
        evicts into the tier stays)."""
        events = self.pool.take_events()
        host = self.host
        if host is None:
            return events
        kept = [e for e in events if e.kind != "removed" or e.hash_value not in host]
        cached = self.pool.cached_digests()
        kept += [KVCacheEvent("removed", d) for d in host.take_dropped() if d not in cached]
        return kept

    def cached_hashes(self) -> list[bytes]:
        """The digests of every block cached, in the pool or the host tier (a snapshot; safe
        to call from another thread)."""
        hashes = self.pool.cached_hashes()
        if self.host is not None:
            in_pool = set(hashes)
            hashes += [d for d in self.host.digests() if d not in in_pool]
        return hashes

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, the host tier's too; only when no block is in use."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.clear()
        return True

    def check_invariants(self, full: bool = True) -> None:
        """Raise AssertionError if the block accounting is inconsistent. ``full=False`` checks
        only the blocks that requests hold (ref counts, none free, nothing leaked), in
        O(held blocks) rather than O(pool): a full check of a GPU's pool of ~360k blocks takes
        ~40 ms of Python, holding the GIL."""
        refs: dict[int, int] = {}
        for table in [*self._tables.values(), *self._held.values()]:
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        if not full:
            self.pool.check_referenced(refs)
            return
        self.pool.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"{block}: ref count != number of tables holding it ({refs.get(block.block_id, 0)})"
            )
