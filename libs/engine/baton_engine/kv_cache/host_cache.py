"""HostBlockCache: the host-memory tier of the prefix cache (vLLM's ``--kv-offloading-size``).

A cached block the device pool evicts (``BlockPool.get_new_blocks`` takes a free block that
still holds a hash for new data) is first copied to a slot of a host buffer; a later request
whose prefix runs past what the pool still caches finds the following blocks here and gets them
copied back into fresh pool blocks instead of computing them again. This class is only the
bookkeeping (which hash each slot holds, least recently used first); the copies are
``KVCopy`` entries that the scheduler hands the runner with the step (``SchedulerOutput``),
which issues them in order on the step's stream before its forward pass. Stream order is what
makes them safe without waiting: a block's save is queued before the forward pass that
overwrites it, a load before the forward pass that reads it, and a slot's load before a later
save that reuses the slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from typing import NamedTuple

from baton_engine.kv_cache.hashing import BlockHash


class KVCopy(NamedTuple):
    """One block's move between the device pool and the host tier."""

    to_host: bool  # True: pool block -> host slot (a save); False: host slot -> pool block
    block_id: int
    slot: int


class HostBlockCache:
    def __init__(self, num_slots: int, record_drops: bool = False) -> None:
        """``record_drops``: keep the digests of the blocks it forgets, for ``take_dropped``
        (the kvstore's prefix index hears of blocks the worker no longer holds anywhere)."""
        if num_slots < 1:
            raise ValueError("the host KV tier needs at least one slot")
        self.num_slots = num_slots
        self._dropped: list[bytes] | None = [] if record_drops else None
        # digest -> slot, least recently used first
        self._slots: OrderedDict[bytes, int] = OrderedDict()
        self._held: list[BlockHash | None] = [None] * num_slots  # slot -> the hash it holds
        self._free = list(range(num_slots - 1, -1, -1))  # (popped from the end: slot 0 first)

    def __len__(self) -> int:
        return len(self._slots)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding ``block_hash``'s block (now the most recently used), or None."""
        slot = self._slots.get(block_hash.hash_value)
        if slot is None:
            return None
        held = self._held[slot]
        # Equal digests with different tokens would be a collision: never hand that block out.
        if held is None or held.token_ids != block_hash.token_ids:
            return None
        self._slots.move_to_end(block_hash.hash_value)
        return slot

    def store(self, block_hash: BlockHash, protected: Collection[int] = ()) -> int | None:
        """A slot to copy ``block_hash``'s block into: a free one, else the least recently
        used one not ``protected`` (slots that loads queued this step still read), whose block
        is forgotten. None when no copy is needed (the tier holds the block already: it
        becomes the most recently used) or every slot is protected."""
        digest = block_hash.hash_value
        if digest in self._slots:
            self._slots.move_to_end(digest)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((d for d, s in self._slots.items() if s not in protected), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            if self._dropped is not None:
                self._dropped.append(victim)
        self._slots[digest] = slot
        self._held[slot] = block_hash
        return slot

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._slots

    def digests(self) -> list[bytes]:
        """The digests of every block held (a snapshot; safe to call from another thread)."""
        return list(self._slots)

    def take_dropped(self) -> list[bytes]:
        """The digests forgotten since the last call (with ``record_drops``)."""
        if self._dropped is None:
            return []
        dropped, self._dropped = self._dropped, []
        return dropped

    def clear(self) -> None:
        """Forget every block (``reset_prefix_cache``)."""
        if self._dropped is not None:
            self._dropped += self._slots
        self._slots.clear()
        self._held = [None] * self.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))

    def check_invariants(self) -> None:
        assert len(self._slots) + len(self._free) == self.num_slots, "a host slot leaked"
        assert len(set(self._slots.values()) | set(self._free)) == self.num_slots, (
            "a host slot is both free and held, or held twice"
        )
        for digest, slot in self._slots.items():
            held = self._held[slot]
            assert held is not None and held.hash_value == digest, f"host slot {slot} mislabelled"
