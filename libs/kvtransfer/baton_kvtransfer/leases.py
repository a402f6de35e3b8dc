"""Leases on KV blocks held by the source (prefill) worker for a puller.

A lease pins a request's blocks until one of three things happens, whichever comes first:
the puller releases it (``release``), its time runs out (``expire_due``, or any call that
finds it past its expiry), or the request is aborted anywhere (``release_request``). Each of
those frees the lease exactly once: it leaves the table and ``on_free(req_id, reason)`` runs
with reason ``"released"``, ``"expired"`` or ``"aborted"``; the owner then frees the blocks.
A freed lease is forgotten, so a later call on it behaves as for an unknown id.

Invariants (``check_invariants``): every live lease is indexed under its request and every
indexed id is live. The table is not thread-safe: use it from one asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from baton_kvtransfer.errors import LeaseUnavailableError

logger = logging.getLogger(__name__)

FreeReason = Literal["released", "expired", "aborted"]
OnFree = Callable[[str, FreeReason], None]  # (req_id, reason)


@dataclass(frozen=True)
class Lease:
    lease_id: str  # uuid4 hex
    req_id: str
    block_ids: tuple[int, ...]  # the source's block ids, in the request's order
    expiry: float  # on the table's clock (time.monotonic by default)
    expiry_unix_ms: int  # the same instant on the wall clock, for the wire


class LeaseTable:
    def __init__(
        self,
        on_free: OnFree,
        *,
        default_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be positive: {default_ttl_s}")
        self.on_free = on_free
        self.default_ttl_s = default_ttl_s
        self.clock = clock
        self.wall_clock = wall_clock
        self._leases: dict[str, Lease] = {}  # lease_id -> live lease
        self._block_sets: dict[str, frozenset[int]] = {}  # lease_id -> its block ids
        self._by_req: dict[str, set[str]] = {}  # req_id -> ids of its live leases
        self.num_expired_total = 0
        self.num_released_total = 0
        self.num_aborted_total = 0

    @property
    def num_active(self) -> int:
        return len(self._leases)

    def grant(self, req_id: str, block_ids: Iterable[int], ttl_s: float | None = None) -> Lease:
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive: {ttl}")
        ids = tuple(int(b) for b in block_ids)
        lease = Lease(uuid.uuid4().hex, req_id, ids, *self._expiry_after(ttl))
        self._leases[lease.lease_id] = lease
        self._block_sets[lease.lease_id] = frozenset(ids)
        self._by_req.setdefault(req_id, set()).add(lease.lease_id)
        return lease

    def get(self, lease_id: str) -> Lease | None:
        """The lease if it is live now (one found past its expiry is freed first)."""
        lease = self._leases.get(lease_id)
        if lease is not None and self.clock() >= lease.expiry:
            self._free(lease_id, "expired")
            return None
        return lease

    def check(self, lease_id: str, block_ids: Sequence[int] = ()) -> Lease:
        """The live lease, after checking that it covers ``block_ids``; raises
        ``LeaseUnavailableError`` if it is unknown, expired or released, or does not."""
        lease = self.get(lease_id)
        if lease is None:
            raise LeaseUnavailableError(f"lease {lease_id} is unknown, expired or released")
        covered = self._block_sets[lease_id]
        foreign = [b for b in block_ids if b not in covered]
        if foreign:
            raise LeaseUnavailableError(
                f"lease {lease_id} (request {lease.req_id}) does not cover blocks {foreign[:8]}"
            )
        return lease

    def extend(self, lease_id: str, extend_ms: int) -> Lease:
        """Keep the lease live at least ``extend_ms`` from now (never shortens it)."""
        lease = self.check(lease_id)
        expiry, expiry_unix_ms = self._expiry_after(extend_ms / 1000)
        if expiry > lease.expiry:
            lease = replace(lease, expiry=expiry, expiry_unix_ms=expiry_unix_ms)
            self._leases[lease_id] = lease
        return lease

    def release(self, lease_id: str) -> bool:
        """Free the lease; True only if it was live until now (so blocks read under it were
        never freed), False if it was unknown, already freed, or past its expiry."""
        if self.get(lease_id) is None:
            return False
        self._free(lease_id, "released")
        return True

    def release_request(self, req_id: str) -> bool:
        """Free every lease of the request (it was aborted); True if there was any."""
        lease_ids = list(self._by_req.get(req_id, ()))
        for lease_id in lease_ids:
            self._free(lease_id, "aborted")
        return bool(lease_ids)

    def expire_due(self, now: float | None = None) -> list[str]:
        """Free every lease past its expiry; returns their ids."""
        now = self.clock() if now is None else now
        due = [lease_id for lease_id, lease in self._leases.items() if now >= lease.expiry]
        for lease_id in due:
            self._free(lease_id, "expired")
        return due

    async def run(self, interval_s: float) -> None:
        """Expire leases every ``interval_s`` until cancelled."""
        while True:
            self.expire_due()
            await asyncio.sleep(interval_s)

    def check_invariants(self) -> None:
        indexed = {lease_id for ids in self._by_req.values() for lease_id in ids}
        assert indexed == set(self._leases) == set(self._block_sets), "lease index out of sync"
        for req_id, ids in self._by_req.items():
            assert ids, f"empty lease set kept for request {req_id}"
            assert all(self._leases[i].req_id == req_id for i in ids), "lease under wrong request"

    def _expiry_after(self, seconds: float) -> tuple[float, int]:
        return self.clock() + seconds, int((self.wall_clock() + seconds) * 1000)

    def _free(self, lease_id: str, reason: FreeReason) -> None:
        lease = self._leases.pop(lease_id)
        del self._block_sets[lease_id]
        req_leases = self._by_req[lease.req_id]
        req_leases.discard(lease_id)
        if not req_leases:
            del self._by_req[lease.req_id]
        if reason == "expired":
            self.num_expired_total += 1
        elif reason == "released":
            self.num_released_total += 1
        else:
            self.num_aborted_total += 1
        try:
            self.on_free(lease.req_id, reason)
        except Exception:  # the lease is gone either way; the owner's bug must not leak it
            logger.exception("on_free failed for request %s (lease %s)", lease.req_id, lease_id)
