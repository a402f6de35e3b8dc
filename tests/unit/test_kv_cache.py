"""BlockPool and KVCacheManager: exact block ids, free-queue order, prefix hits, eviction, refs.

Conventions: a fresh pool hands out block ids 0, 1, 2, ...; a request's blocks are freed tail
first; the free queue is evicted head first (least recently freed first).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from baton_engine.kv_cache import (
    BlockHash,
    BlockPool,
    KVCacheManager,
    PrefixMatch,
    hash_block_tokens,
    hash_request_tokens,
)
from baton_engine.kv_cache.block_pool import KVCacheEvent
from baton_engine.kv_cache.hashing import prefix_root
from baton_engine.kv_cache.host_cache import KVCopy
from baton_engine.request import Request
from baton_engine.sampling_params import SamplingParams

BLOCK_SIZE = 16


# --- factories ----------------------------------------------------------------------------------


def make_request(req_id: str, token_ids: Sequence[int], *, max_tokens: int = 16) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
    )


def make_manager(
    num_blocks: int = 10, block_size: int = BLOCK_SIZE, enable_caching: bool = True
) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_caching, enable_kv_events=True)


def tokens(n: int, start: int = 0) -> list[int]:
    """``n`` distinct token ids from ``start`` (different starts give unrelated prompts)."""
    return list(range(start, start + n))


def admit(kv: KVCacheManager, request: Request) -> tuple[PrefixMatch, list[int]]:
    """Do what the scheduler does for a waiting request that gets all its tokens this step."""
    prefix = kv.match_prefix(request)
    num_new = request.num_tokens - request.num_computed_tokens - prefix.num_cached_tokens
    block_ids = kv.allocate_slots(request, num_new, prefix)
    assert block_ids is not None, f"{request.req_id} did not fit"
    request.num_computed_tokens += prefix.num_cached_tokens + num_new
    return prefix, block_ids


def decode(kv: KVCacheManager, request: Request, token_id: int) -> list[int] | None:
    """Append one sampled token and make room to compute it (one decode step)."""
    request.append_output_token(token_id)
    block_ids = kv.allocate_slots(request, 1)
    if block_ids is not None:
        request.num_computed_tokens += 1
    return block_ids


def refs(kv: KVCacheManager, block_ids: Sequence[int]) -> list[int]:
    return [kv.pool.blocks[i].ref_cnt for i in block_ids]


# --- BlockPool ----------------------------------------------------------------------------------


def test_fresh_pool_hands_out_ids_in_order() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_ids() == [3, 4, 5, 6, 7]
    assert pool.num_free_blocks == 5
    assert pool.usage() == pytest.approx(3 / 8)
    pool.check_invariants()


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_blocks_beyond_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.free_block_ids() == [3]
    pool.check_invariants()


def test_freed_blocks_join_the_tail_and_lru_is_reused_first() -> None:
    pool = BlockPool(6)
    b = pool.get_new_blocks(4)  # 0, 1, 2, 3
    pool.free_blocks([b[2], b[0]])
    assert pool.free_block_ids() == [4, 5, 2, 0]
    pool.free_blocks([b[3]])
    assert pool.free_block_ids() == [4, 5, 2, 0, 3]
    assert [x.block_id for x in pool.get_new_blocks(4)] == [4, 5, 2, 0]
    assert pool.free_block_ids() == [3]
    pool.check_invariants()


def test_touch_revives_a_free_block_and_shares_a_used_one() -> None:
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    pool.free_blocks([b0])
    assert pool.free_block_ids() == [2, 3, 0]
    pool.touch([b0, b1])
    assert (b0.ref_cnt, b1.ref_cnt) == (1, 2)
    assert pool.free_block_ids() == [2, 3]
    pool.check_invariants()


def test_invariant_check_catches_a_broken_free_queue() -> None:
    """The free queue is linked through the blocks: a link that skips a block, or a block in
    use that still links into the queue, fails the check."""
    pool = BlockPool(6)
    (taken,) = pool.get_new_blocks(1)
    pool.check_invariants()
    block3, block5 = pool.blocks[3], pool.blocks[5]
    saved = block3.prev_free
    block3.prev_free = block5
    with pytest.raises(AssertionError, match="back link"):
        pool.check_invariants()
    block3.prev_free = saved
    pool.check_invariants()
    taken.next_free = block3
    with pytest.raises(AssertionError, match="links"):
        pool.check_invariants()


def test_cached_block_lookup_checks_token_ids() -> None:
    """Equal digests with different tokens (a collision) must never be shared."""
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    stored = BlockHash(b"\x01" * 16, (1, 2, 3, 4))
    pool.cache_full_blocks([block], [stored], 0, 1)
    assert pool.get_cached_block(BlockHash(b"\x01" * 16, (1, 2, 3, 4))) is block
    assert pool.get_cached_block(BlockHash(b"\x01" * 16, (1, 2, 3, 5))) is None
    assert pool.get_cached_block(BlockHash(b"\x02" * 16, (1, 2, 3, 4))) is None


def test_pool_without_caching_indexes_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    block_hash = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([block], [block_hash], 0, 1)
    assert block.block_hash is None
    assert pool.get_cached_block(block_hash) is None
    assert pool.take_events() == []


# --- hashing ------------------------------------------------------------------------------------


def test_hashes_chain_on_the_parent() -> None:
    block = tokens(BLOCK_SIZE, 1000)
    alone = hash_block_tokens(None, block)
    after_a = hash_block_tokens(hash_block_tokens(None, tokens(BLOCK_SIZE, 0)), block)
    after_b = hash_block_tokens(hash_block_tokens(None, tokens(BLOCK_SIZE, 500)), block)
    assert len({alone.hash_value, after_a.hash_value, after_b.hash_value}) == 3
    assert alone.token_ids == after_a.token_ids == tuple(block)
    assert len(alone.hash_value) == 16
    # Deterministic: the kvstore's index keys on the same digests.
    assert hash_block_tokens(None, block) == alone


def test_hash_request_tokens_covers_full_blocks_and_extends() -> None:
    ids = tokens(2 * BLOCK_SIZE + 8)
    hashes = hash_request_tokens(ids, BLOCK_SIZE)
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hashes[0], ids[BLOCK_SIZE : 2 * BLOCK_SIZE])
    longer = ids + tokens(8, 5000)
    assert hash_request_tokens(longer, BLOCK_SIZE, hashes) == hash_request_tokens(
        longer, BLOCK_SIZE
    )
    assert hash_request_tokens(tokens(BLOCK_SIZE - 1), BLOCK_SIZE) == []


def test_request_hashes_follow_prompt_and_output_tokens() -> None:
    """The manager extends a request's hashes as blocks fill, across the prompt/output seam."""
    kv = make_manager()
    a = make_request("a", tokens(20))
    assert kv.block_hashes(a) == hash_request_tokens(a.all_token_ids, BLOCK_SIZE)  # 1 block
    for t in range(40):
        a.append_output_token(7000 + t)
        assert kv.block_hashes(a) == hash_request_tokens(a.all_token_ids, BLOCK_SIZE)
    assert len(kv.block_hashes(a)) == 3


def test_same_block_after_different_prefixes_does_not_hit() -> None:
    kv = make_manager()
    shared_tail = tokens(BLOCK_SIZE, 9000)
    a = make_request("a", tokens(BLOCK_SIZE, 0) + shared_tail + [1])
    b = make_request("b", tokens(BLOCK_SIZE, 500) + shared_tail + [1])
    admit(kv, a)
    assert kv.block_hashes(a)[1] != kv.block_hashes(b)[1]
    assert kv.match_prefix(b).num_cached_tokens == 0


def test_collision_in_the_index_is_a_miss() -> None:
    """A request whose block hashes to a cached digest with other tokens gets no hit."""
    kv = make_manager()
    a = make_request("a", tokens(BLOCK_SIZE + 1))
    admit(kv, a)
    b = make_request("b", tokens(BLOCK_SIZE + 1, 100))
    forged = BlockHash(kv.block_hashes(a)[0].hash_value, tuple(tokens(BLOCK_SIZE, 100)))
    kv._hashes["b"] = [forged]  # as if b's first block collided with a's
    assert kv.match_prefix(b) == PrefixMatch(0, [])


# --- KVCacheManager: allocation and freeing -----------------------------------------------------


def test_allocate_hands_out_fresh_ids() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(40))
    prefix, block_ids = admit(kv, a)
    assert prefix.num_cached_tokens == 0
    assert block_ids == [0, 1, 2]
    b = make_request("b", tokens(17, 100))
    assert admit(kv, b)[1] == [3, 4]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    kv.check_invariants()


def test_decode_takes_a_block_only_at_a_block_boundary() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(46))
    admit(kv, a)
    assert decode(kv, a, 1) == []  # token 47 fits in block 2
    assert decode(kv, a, 2) == []  # token 48 fills block 2
    assert decode(kv, a, 3) == [3]  # token 49 starts block 3
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    kv.check_invariants()


def test_allocate_in_chunks_appends_to_the_table() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(70))
    for num_new, expected in [(20, [0, 1]), (12, []), (30, [2, 3]), (8, [4])]:
        assert kv.allocate_slots(a, num_new) == expected
        a.num_computed_tokens += num_new
    assert a.num_computed_tokens == 70
    assert kv.get_block_ids("a") == [0, 1, 2, 3, 4]
    kv.check_invariants()


def test_free_is_reverse_order_so_tails_are_evicted_first() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(40))
    admit(kv, a)
    kv.free(a)
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert kv.get_block_ids("a") == []
    kv.check_invariants()


def test_least_recently_freed_request_is_evicted_first() -> None:
    kv = make_manager(num_blocks=6)
    a = make_request("a", tokens(32))
    b = make_request("b", tokens(32, 100))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    assert kv.pool.free_block_ids() == [4, 5, 1, 0, 3, 2]
    c = make_request("c", tokens(6 * BLOCK_SIZE, 1000))
    assert admit(kv, c)[1] == [4, 5, 1, 0, 3, 2]
    kv.check_invariants()


def test_allocate_fails_cleanly_when_the_pool_is_too_small() -> None:
    kv = make_manager(num_blocks=4)
    a = make_request("a", tokens(48))
    admit(kv, a)
    b = make_request("b", tokens(17, 100))  # needs 2 blocks, 1 free
    assert kv.allocate_slots(b, 17) is None
    assert kv.get_block_ids("b") == []
    assert kv.pool.free_block_ids() == [3]
    assert refs(kv, [0, 1, 2, 3]) == [1, 1, 1, 0]
    assert decode(kv, a, 7) == [3]  # a running request can still grow into the free block
    assert decode(kv, a, 7) == []
    kv.check_invariants()


def test_allocate_fails_cleanly_when_revived_hits_do_not_fit() -> None:
    """Hits on free blocks leave the free queue too, so they count against it."""
    kv = make_manager(num_blocks=4)
    a = make_request("a", tokens(33))
    admit(kv, a)  # blocks 0, 1 full and cached, block 2 partial
    kv.free(a)
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    events = kv.take_events()
    b = make_request("b", tokens(32) + tokens(40, 100))  # 72 tokens: 5 blocks
    prefix = kv.match_prefix(b)
    assert (prefix.num_cached_tokens, prefix.block_ids) == (32, [0, 1])
    assert kv.allocate_slots(b, 40, prefix) is None
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    assert refs(kv, [0, 1, 2, 3]) == [0, 0, 0, 0]
    assert kv.match_prefix(b).block_ids == [0, 1]  # nothing was evicted
    assert kv.take_events() == []
    assert len(events) == 2
    kv.check_invariants()


# --- prefix caching -----------------------------------------------------------------------------


def test_second_request_hits_the_shared_prefix() -> None:
    kv = make_manager(num_blocks=10)
    prefix_ids = tokens(3 * BLOCK_SIZE)
    a = make_request("a", prefix_ids + tokens(5, 1000))
    b = make_request("b", prefix_ids + tokens(5, 2000))
    assert admit(kv, a)[1] == [0, 1, 2, 3]
    prefix, block_ids = admit(kv, b)
    assert prefix.num_cached_tokens == 48
    assert prefix.block_ids == [0, 1, 2]
    assert block_ids == [0, 1, 2, 4]
    assert kv.get_block_ids("b") == [0, 1, 2, 4]
    assert refs(kv, [0, 1, 2, 3, 4]) == [2, 2, 2, 1, 1]
    assert kv.num_free_blocks == 5
    kv.check_invariants()


def test_a_cache_salt_shares_blocks_only_with_the_same_salt() -> None:
    """vLLM's cache_salt: the same prompt under another salt (or none) hits nothing, so one
    tenant cannot learn from a hit what another sent; under the same salt it hits as usual.
    A salt and a LoRA adapter make a root of their own."""
    kv = make_manager(num_blocks=20)
    prompt = tokens(3 * BLOCK_SIZE + 1)

    def salted(req_id: str, salt: str | None, lora: str | None = None) -> Request:
        request = make_request(req_id, prompt)
        request.cache_salt, request.lora_name = salt, lora
        return request

    assert admit(kv, salted("a", "tenant-1"))[0].num_cached_tokens == 0
    assert admit(kv, salted("b", "tenant-1"))[0].num_cached_tokens == 3 * BLOCK_SIZE
    for req_id, salt in (("c", "tenant-2"), ("d", None)):
        assert admit(kv, salted(req_id, salt))[0].num_cached_tokens == 0
    assert admit(kv, salted("e", None))[0].num_cached_tokens == 3 * BLOCK_SIZE  # ("d"'s)
    roots = {
        prefix_root(lora, salt)
        for lora, salt in ((None, None), ("x", None), (None, "x"), ("x", "x"), ("x", "y"))
    }
    assert len(roots) == 5 and prefix_root(None, None) is None


def test_hit_is_capped_below_num_tokens() -> None:
    """The last token is always recomputed: its logits are needed to sample."""
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(32))
    admit(kv, a)
    exact = make_request("exact", tokens(32))
    assert (kv.match_prefix(exact).num_cached_tokens, kv.match_prefix(exact).block_ids) == (
        16,
        [0],
    )
    _, block_ids = admit(kv, exact)
    assert block_ids == [0, 2]  # block 1's tokens are recomputed into a fresh block
    longer = make_request("longer", [*tokens(32), 99])
    assert kv.match_prefix(longer).num_cached_tokens == 32
    assert kv.match_prefix(longer).block_ids == [0, 1]
    kv.check_invariants()


def test_hit_on_freed_blocks_revives_them() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(50))
    admit(kv, a)  # [0, 1, 2, 3]
    kv.free(a)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    b = make_request("b", tokens(48) + tokens(10, 500))
    prefix, block_ids = admit(kv, b)
    assert prefix.block_ids == [0, 1, 2]
    assert block_ids == [0, 1, 2, 4]
    assert kv.pool.free_block_ids() == [5, 6, 7, 8, 9, 3]
    assert refs(kv, [0, 1, 2, 3, 4]) == [1, 1, 1, 0, 1]
    kv.check_invariants()


def test_shared_blocks_stay_in_use_until_every_owner_frees() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(40))
    b = make_request("b", tokens(40))
    admit(kv, a)  # [0, 1, 2]
    admit(kv, b)  # [0, 1, 3]
    assert refs(kv, [0, 1, 2, 3]) == [2, 2, 1, 1]
    kv.free(a)
    assert refs(kv, [0, 1, 2, 3]) == [1, 1, 0, 1]
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]
    kv.check_invariants()
    kv.free(b)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    kv.check_invariants()


def test_taking_a_cached_block_evicts_its_hash() -> None:
    kv = make_manager(num_blocks=4)
    a = make_request("a", tokens(33))
    admit(kv, a)  # [0, 1, 2]; 0 and 1 full and cached
    h0, h1 = (h.hash_value for h in kv.block_hashes(a))
    assert kv.take_events() == [KVCacheEvent("stored", h0), KVCacheEvent("stored", h1)]
    kv.free(a)
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    c = make_request("c", tokens(40, 1000))
    assert admit(kv, c)[1] == [3, 2, 1]  # block 1 (a's chain tail) is evicted for new data
    c0, c1 = (h.hash_value for h in kv.block_hashes(c))
    assert kv.take_events() == [
        KVCacheEvent("removed", h1),
        KVCacheEvent("stored", c0),
        KVCacheEvent("stored", c1),
    ]
    kv.free(c)
    b = make_request("b", tokens(33))
    prefix = kv.match_prefix(b)
    assert (prefix.num_cached_tokens, prefix.block_ids) == (16, [0])  # the head survived
    kv.check_invariants()


def test_events_report_each_hash_once() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(40))
    b = make_request("b", tokens(40))
    admit(kv, a)
    admit(kv, b)  # hits a's blocks: nothing new to store
    stored = [e.hash_value for e in kv.take_events() if e.kind == "stored"]
    assert stored == [h.hash_value for h in kv.block_hashes(a)]
    assert kv.take_events() == []


def test_chunked_prefill_caches_blocks_as_they_fill() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(40))
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    b = make_request("b", tokens(40))
    assert kv.match_prefix(b).block_ids == [0]
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 40
    assert kv.match_prefix(b).block_ids == [0, 1]


def test_decode_tokens_fill_blocks_that_later_requests_hit() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(30))
    admit(kv, a)
    for t in (7, 8):
        decode(kv, a, t)  # 32 tokens: block 1 full of prompt + output tokens
    b = make_request("b", [*tokens(30), 7, 8, 9])
    assert kv.match_prefix(b).block_ids == [0, 1]


def test_caching_disabled_never_hits() -> None:
    kv = make_manager(num_blocks=10, enable_caching=False)
    a = make_request("a", tokens(50))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", tokens(50))
    prefix, block_ids = admit(kv, b)
    assert prefix == PrefixMatch(0, [])
    assert block_ids == [4, 5, 6, 7]
    assert all(blk.block_hash is None for blk in kv.pool.blocks)
    assert kv.take_events() == []
    kv.check_invariants()


def test_reset_prefix_cache_only_when_idle() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(40))
    admit(kv, a)
    kv.take_events()
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert [e.kind for e in kv.take_events()] == ["removed", "removed"]
    assert kv.match_prefix(make_request("b", tokens(40))).num_cached_tokens == 0
    kv.check_invariants()


def test_forget_drops_hashes_but_keeps_the_cache() -> None:
    kv = make_manager(num_blocks=10)
    a = make_request("a", tokens(40))
    admit(kv, a)
    kv.forget(a)
    assert "a" not in kv._hashes
    assert kv.match_prefix(make_request("b", tokens(40))).num_cached_tokens == 32


# --- randomized ---------------------------------------------------------------------------------


class _Model:
    """A reference for the pool's free queue and ref counts, plus what each block holds."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.free = list(range(kv.pool.num_blocks))
        self.ref = [0] * kv.pool.num_blocks
        # block_id -> token written at each slot (None: not written since the block was taken)
        self.content: list[list[int | None]] = [
            [None] * kv.block_size for _ in range(kv.pool.num_blocks)
        ]

    def allocated(
        self, request: Request, hits: list[int], new: list[int], start: int, num_new: int
    ) -> None:
        """``request`` got ``hits`` and ``new`` blocks and computes ``num_new`` from ``start``."""
        for block_id in hits:
            if self.ref[block_id] == 0:
                self.free.remove(block_id)
            self.ref[block_id] += 1
        assert new == self.free[: len(new)], "new blocks must come from the free-queue head"
        del self.free[: len(new)]
        for block_id in new:
            self.ref[block_id] = 1
            self.content[block_id] = [None] * self.kv.block_size
        table = self.kv.get_block_ids(request.req_id)
        all_ids = request.all_token_ids
        bs = self.kv.block_size
        for pos in range(start, start + num_new):
            block_id = table[pos // bs]
            assert self.ref[block_id] == 1, f"writing into shared block {block_id}"
            self.content[block_id][pos % bs] = all_ids[pos]

    def freed(self, table: list[int]) -> None:
        for block_id in reversed(table):
            self.ref[block_id] -= 1
            if self.ref[block_id] == 0:
                self.free.append(block_id)

    def check(self, live: dict[str, Request]) -> None:
        self.kv.check_invariants()
        self.kv.check_invariants(full=False)
        assert self.kv.pool.free_block_ids() == self.free
        assert [b.ref_cnt for b in self.kv.pool.blocks] == self.ref
        bs = self.kv.block_size
        for request in live.values():
            table = self.kv.get_block_ids(request.req_id)
            assert len(table) == -(request.num_computed_tokens // -bs)
            all_ids = request.all_token_ids
            for pos in range(request.num_computed_tokens):
                held = self.content[table[pos // bs]][pos % bs]
                assert held == all_ids[pos], f"{request.req_id} reads wrong KV at {pos}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_operations_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    kv = make_manager(num_blocks=48, block_size=4)
    model = _Model(kv)
    vocab = 6  # tiny, so independent tails also collide into shared blocks now and then
    prefixes = [[rng.randrange(vocab) for _ in range(n)] for n in (0, 5, 12, 23)]
    live: dict[str, Request] = {}  # req_id -> request holding blocks (or preempted, holding none)
    num_hits = num_preempted = num_failed = 0

    def schedule(request: Request, num_new: int, prefix: PrefixMatch | None) -> bool:
        block_ids = kv.allocate_slots(request, num_new, prefix)
        if block_ids is None:
            return False
        hits = prefix.block_ids if prefix is not None else []
        assert block_ids[: len(hits)] == hits
        start = request.num_computed_tokens + (prefix.num_cached_tokens if prefix else 0)
        model.allocated(request, hits, block_ids[len(hits) :], start, num_new)
        request.num_computed_tokens = start + num_new
        return True

    def preempt(request: Request) -> None:
        model.freed(kv.get_block_ids(request.req_id))
        kv.free(request)
        request.num_computed_tokens = 0

    for step in range(2000):
        op = rng.random()
        if op < 0.2 or not live:
            req_id = f"r{step}"
            prompt = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            live[req_id] = make_request(req_id, prompt)
        request = live[rng.choice(list(live))]
        if op < 0.85:
            prefix = None
            if request.num_computed_tokens == 0:  # waiting: look up the prefix cache
                prefix = kv.match_prefix(request)
                assert prefix.num_cached_tokens % kv.block_size == 0
                assert prefix.num_cached_tokens <= request.num_tokens - 1
                num_hits += bool(prefix.blocks)
            elif request.num_computed_tokens == request.num_tokens:  # decode: sample a token
                request.append_output_token(rng.randrange(vocab))
            cached = prefix.num_cached_tokens if prefix is not None else 0
            remaining = request.num_tokens - request.num_computed_tokens - cached
            if not schedule(request, rng.randint(1, remaining), prefix):
                num_failed += 1
                if request.num_computed_tokens > 0:
                    preempt(request)
                    num_preempted += 1
            assert kv.block_hashes(request) == hash_request_tokens(
                request.all_token_ids, kv.block_size
            )
        elif op < 0.93:
            preempt(request)
            num_preempted += 1
        else:
            model.freed(kv.get_block_ids(request.req_id))
            kv.forget(request)
            del live[request.req_id]
        model.check(live)

    assert num_hits > 50 and num_preempted > 50 and num_failed > 10


@pytest.mark.parametrize("full", [True, False])
def test_invariant_checks_catch_a_leak_and_a_bad_ref_count(full: bool) -> None:
    """Both checks (the full one, and the one of held blocks only that large GPU pools get
    when idle) fail on a block in use that no request holds, and on a wrong ref count."""
    kv = make_manager(num_blocks=16, block_size=4)
    request = make_request("a", list(range(10)))
    assert kv.allocate_slots(request, 10, kv.match_prefix(request)) is not None
    kv.check_invariants(full)
    leaked = kv.pool.get_new_blocks(1)  # taken from the free queue, held by nobody
    with pytest.raises(AssertionError):
        kv.check_invariants(full)
    kv.pool.free_blocks(leaked)
    kv.check_invariants(full)
    block = kv.pool.blocks[kv.get_block_ids("a")[0]]
    block.ref_cnt += 1
    with pytest.raises(AssertionError):
        kv.check_invariants(full)
    block.ref_cnt -= 1
    kv.free(request)
    kv.check_invariants(full)


# --- the host tier (--kv-offloading-size) -------------------------------------------------------


def make_tiered(num_blocks: int, num_host_blocks: int, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, num_host_blocks=num_host_blocks)


def test_host_tier_saves_evicted_blocks_and_loads_them_back() -> None:
    kv = make_tiered(num_blocks=4, num_host_blocks=8)
    a = make_request("a", tokens(13))  # 3 full blocks and 1 token
    admit(kv, a)
    assert kv.take_copies() == []  # nothing evicted yet
    a_blocks = kv.get_block_ids("a")
    kv.forget(a)
    b = make_request("b", tokens(15, start=100))
    admit(kv, b)  # takes all 4 blocks: the free queue's head first, a's tail first
    # a's three cached blocks go to the tier as they are taken (its partial block has no hash)
    saves = kv.take_copies()
    assert saves == [KVCopy(True, a_blocks[2], 0), KVCopy(True, a_blocks[1], 1),
                     KVCopy(True, a_blocks[0], 2)]  # fmt: skip
    kv.forget(b)
    again = make_request("a2", tokens(13))
    prefix = kv.match_prefix(again)
    assert prefix.blocks == [] and prefix.host_slots == (2, 1, 0)
    assert prefix.num_cached_tokens == 12
    new_ids = kv.allocate_slots(again, 1, prefix)
    assert new_ids is not None and len(new_ids) == 4
    copies = kv.take_copies()
    # b's three cached blocks are saved as they are taken, then a's come back into the first
    # three new blocks, in prefix order
    assert [c.to_host for c in copies] == [True, True, True, False, False, False]
    loads = [(c.block_id, c.slot) for c in copies[3:]]
    assert loads == list(zip(new_ids[:3], (2, 1, 0), strict=True))
    # the loaded blocks are cached in the pool again: the next request hits them there
    again.num_computed_tokens = 13
    third = make_request("a3", tokens(13))
    assert kv.match_prefix(third).block_ids == new_ids[:3]
    kv.record_prefix_lookup(13, prefix)
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (13, 0)
    assert (kv.num_host_queries, kv.num_host_hits) == (13, 12)
    kv.check_invariants()


def test_host_tier_hits_continue_a_pool_prefix() -> None:
    """A prefix whose head the pool still caches runs on into the tier's blocks."""
    kv = make_tiered(num_blocks=5, num_host_blocks=8)
    a = make_request("a", tokens(17))  # 4 full blocks and 1 token: all 5 blocks
    admit(kv, a)
    a_blocks = kv.get_block_ids("a")
    kv.forget(a)  # freed tail first: a's last blocks are evicted first
    b = make_request("b", tokens(8, start=100))
    admit(kv, b)  # takes a's partial block and its 4th
    kv.forget(b)
    assert kv.take_copies() == [KVCopy(True, a_blocks[3], 0)]
    prefix = kv.match_prefix(make_request("a2", tokens(17)))
    assert prefix.block_ids == a_blocks[:3] and prefix.host_slots == (0,)
    assert prefix.num_cached_tokens == 16


def test_host_tier_copies_a_block_once_and_evicts_least_recently_used() -> None:
    """Each request takes the whole pool (a full block and a partial one), so each evicts
    the one before it."""
    kv = make_tiered(num_blocks=2, num_host_blocks=2, block_size=4)
    assert kv.host is not None

    def cycle(name: str, start: int) -> list[KVCopy]:
        request = make_request(name, tokens(5, start=start))
        admit(kv, request)
        kv.forget(request)
        return kv.take_copies()

    def held(start: int) -> int | None:
        return kv.host._slots.get(hash_block_tokens(None, tokens(4, start=start)).hash_value)

    assert cycle("x", 0) == []
    assert cycle("y", 100) == [KVCopy(True, 0, 0)]  # x's full block, in block 0
    assert cycle("z", 200) == [KVCopy(True, 1, 1)]  # y's
    # x again: from slot 0 (now the tier's most recent); z's block is saved over y's, the
    # least recently used, before x's is loaded into the block z's leaves
    assert cycle("x2", 0) == [KVCopy(True, 0, 1), KVCopy(False, 1, 0)]
    assert (held(0), held(100), held(200)) == (0, None, 1)
    assert cycle("w", 300) == []  # x's block is evicted again: the tier holds it already
    assert cycle("v", 400) == [KVCopy(True, 0, 1)]  # w's, over z's (x's was used since)
    assert (held(0), held(200), held(300)) == (0, None, 1)
    kv.check_invariants()


def test_host_tier_never_overwrites_a_slot_it_is_loading_from() -> None:
    """An allocation that loads from the tier and evicts pool blocks the tier has no free
    slot for: the slots being loaded are not taken (the eviction's save is dropped)."""
    kv = make_tiered(num_blocks=3, num_host_blocks=2, block_size=4)
    a = make_request("a", tokens(9))  # 2 full blocks and 1 token: the whole pool
    admit(kv, a)
    kv.forget(a)
    b = make_request("b", tokens(9, start=100))
    admit(kv, b)  # a's 2 full blocks fill the tier's 2 slots
    kv.forget(b)
    assert sorted(c.slot for c in kv.take_copies()) == [0, 1]
    again = make_request("a2", tokens(9))
    prefix = kv.match_prefix(again)
    assert prefix.host_slots == (1, 0)
    assert kv.allocate_slots(again, 1, prefix) is not None
    # b's 2 cached blocks are evicted, but both slots are being loaded: no save
    copies = kv.take_copies()
    assert [c.to_host for c in copies] == [False, False]
    assert len(kv.host) == 2 and kv.host.lookup(hash_request_tokens(tokens(9), 4)[0]) == 1


def test_host_tier_refuses_a_colliding_digest_and_resets() -> None:
    kv = make_tiered(num_blocks=2, num_host_blocks=4)
    real = hash_block_tokens(None, tokens(4))
    forged = BlockHash(real.hash_value, tuple(tokens(4, start=50)))
    assert kv.host is not None and kv.host.store(real) == 0
    assert kv.host.lookup(forged) is None and kv.host.lookup(real) == 0
    assert kv.host.store(real) is None  # held already
    assert kv.reset_prefix_cache() and len(kv.host) == 0 and kv.host.lookup(real) is None
    kv.check_invariants()
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(4, 4, enable_caching=False, num_host_blocks=4)


def test_kv_events_count_the_host_tier_as_the_workers() -> None:
    """The kvstore's index hears that a block is removed only once neither the pool nor the
    tier holds it; a resync's snapshot names the tier's blocks too."""
    kv = KVCacheManager(2, 4, enable_kv_events=True, num_host_blocks=1)
    x, y, z = (hash_block_tokens(None, tokens(4, start=s)).hash_value for s in (0, 100, 200))

    def cycle(name: str, start: int) -> list[tuple[str, bytes]]:
        request = make_request(name, tokens(5, start=start))  # takes the whole pool
        admit(kv, request)
        kv.forget(request)
        kv.take_copies()
        return [(e.kind, e.hash_value) for e in kv.take_events()]

    assert cycle("x", 0) == [("stored", x)]
    assert cycle("y", 100) == [("stored", y)]  # x's block went to the tier: not removed
    assert set(kv.cached_hashes()) == {x, y}
    # z evicts y's block into the tier's one slot, which drops x
    assert cycle("z", 200) == [("stored", z), ("removed", x)]
    assert set(kv.cached_hashes()) == {y, z}
    # y comes back from the tier; z's block, evicted meanwhile, finds the one slot being
    # loaded from: z is held nowhere now
    assert cycle("y2", 100) == [("removed", z), ("stored", y)]
    assert kv.reset_prefix_cache()
    assert {(e.kind, e.hash_value) for e in kv.take_events()} == {("removed", y)}
    assert kv.cached_hashes() == []


class _SimulatedDevice:
    """What each pool block and host slot holds (the digest of the block whose KV it is),
    moved by a step's copies as the runner moves bytes, and written by the forward pass."""

    def __init__(self) -> None:
        self.pool: dict[int, bytes | None] = {}
        self.host: dict[int, bytes | None] = {}

    def run(self, copies: Sequence[KVCopy]) -> None:
        for to_host, block_id, slot in copies:
            if to_host:
                self.host[slot] = self.pool.get(block_id)
            else:
                self.pool[block_id] = self.host.get(slot)


@pytest.mark.parametrize("seed", range(4))
def test_host_tier_randomized_every_hit_holds_its_tokens_kv(seed: int) -> None:
    """Random requests over shared prefixes, a small pool and a smaller tier: after each
    step's copies run in order, every block of a request's cached prefix (pool or tier hit)
    holds the KV of exactly its tokens."""
    rng = random.Random(seed)
    block_size = 4
    kv = make_tiered(num_blocks=24, num_host_blocks=10, block_size=block_size)
    device = _SimulatedDevice()
    stems = [tokens(rng.randrange(8, 40), start=1000 * i) for i in range(6)]
    live: list[Request] = []
    num_host_hits = 0
    for step in range(400):
        if live and (rng.random() < 0.5 or len(live) > 3):
            kv.forget(live.pop(rng.randrange(len(live))))
            continue
        stem = rng.choice(stems)
        request = make_request(f"r{step}", stem + tokens(rng.randrange(1, 12), start=10**6 + step))
        prefix = kv.match_prefix(request)
        num_new = request.num_tokens - prefix.num_cached_tokens
        if kv.allocate_slots(request, num_new, prefix) is None:
            kv.take_copies()  # (a failed allocation queues nothing)
            continue
        device.run(kv.take_copies())
        table = kv.get_block_ids(request.req_id)
        hashes = kv.block_hashes(request)
        num_cached = prefix.num_cached_tokens // block_size
        for i in range(num_cached):
            assert device.pool[table[i]] == hashes[i].hash_value, (step, i)
        num_host_hits += len(prefix.host_slots)
        for i in range(num_cached, len(table)):  # the forward pass writes the rest
            full = i < len(hashes)
            device.pool[table[i]] = hashes[i].hash_value if full else None
        request.num_computed_tokens = request.num_tokens
        live.append(request)
        kv.check_invariants()
    assert num_host_hits > 20


def test_lookahead_room_after_the_scheduled_tokens() -> None:
    """``num_lookahead_tokens`` (a draft model's drafts' KV): each allocation leaves that many
    slots after the scheduled tokens, never past ``max_model_len``, and the request's limit
    for skipping ``allocate_slots`` keeps that room."""
    kv = KVCacheManager(10, BLOCK_SIZE, num_lookahead_tokens=3, max_model_len=64)
    request = make_request("a", tokens(28))
    assert kv.allocate_slots(request, 28) == [0, 1]  # 31 slots
    request.num_computed_tokens = 28
    assert request.kv_limit == 2 * BLOCK_SIZE - 3
    assert kv.allocate_slots(request, 1) == []  # 32 slots
    assert kv.allocate_slots(request, 2) == [2]  # 33
    # near the end of the context: room up to max_model_len only
    long = make_request("b", tokens(62, start=100))
    assert kv.allocate_slots(long, 62) == [3, 4, 5, 6]  # 64 slots, not 65
    long.num_computed_tokens = 62
    assert kv.allocate_slots(long, 1) == []
    assert kv.num_free_blocks == 3
