"""The kvstore's state behind one interface: the worker directory and the global prefix index.

Both stores behave identically (the same tests run against both):

- **Directory.** ``register(info, ttl_ms)`` (re)writes a worker's record, live for ``ttl_ms``;
  ``heartbeat`` records its load and extends it by the same TTL, and answers False once the
  record is gone (expired, deregistered, or the store lost its state), so the worker registers
  again. Registering also resets the worker's index state: whatever it cached before is unknown.
- **Index.** Per worker: the set of block hashes it caches and the seq of the last event applied.
  ``publish`` applies a batch only if it continues that seq (see ``plan_batch``); otherwise, and
  for workers the directory does not know, it applies nothing and asks for a resync (CLEARED,
  then STORED with everything the worker caches). A worker's index state goes with its record
  (the memory store drops it on expiry; Redis keys carry the record's TTL).
- **Lookup.** ``lookup_prefix`` answers every live worker of the role with the number of LEADING
  hashes of the prompt it caches, most first (ties by worker id).

``MemoryStore`` is the embedded default; ``RedisStore`` (``redis_store.py``) keeps the same state
in Redis (keys with TTL, one set per worker, a stream as the log of applied batches). While Redis
is unreachable every call raises ``StoreUnavailableError``; a Redis restart (empty state) looks
like every worker having expired, which heartbeats and publishes then report.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any, NamedTuple

from baton_engine.errors import BatonError, InvalidRequestError
from baton_kvstore.codec import KVEvent, PrefixMatch, Role, WorkerInfo, WorkerLoad


class StoreUnavailableError(BatonError):
    """The backing store (Redis) cannot be reached; the call may succeed later."""


class PublishResult(NamedTuple):
    resync_required: bool
    num_applied: int  # events applied to the index (duplicates and refused batches: 0)


def plan_batch(last_seq: int | None, events: Sequence[KVEvent]) -> tuple[KVEvent, ...] | None:
    """The events of a batch to apply, given the worker's last applied seq (None: the index does
    not know the worker); None means apply nothing and ask for a resync.

    A batch that starts with CLEARED is always applied (it resets the set and the baseline).
    Otherwise events at or below ``last_seq`` are duplicates and skipped, and the rest must start
    at ``last_seq + 1``. Raises ``InvalidRequestError`` unless seqs grow by exactly 1 per event.
    """
    for prev, event in pairwise(events):
        if event.seq != prev.seq + 1:
            raise InvalidRequestError(
                f"event seqs must grow by 1 within a batch, got {prev.seq} then {event.seq}"
            )
    if events and events[0].kind == "cleared":
        return tuple(events)
    if last_seq is None:
        return None
    fresh = tuple(e for e in events if e.seq > last_seq)
    if fresh and fresh[0].seq != last_seq + 1:
        return None
    return fresh


def check_ttl(ttl_ms: int) -> None:
    if ttl_ms <= 0:
        raise InvalidRequestError(f"ttl_ms must be positive, got {ttl_ms}")


def leading(flags: Iterable[Any]) -> int:
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


def ranked(matches: Iterable[PrefixMatch]) -> list[PrefixMatch]:
    return sorted(matches, key=lambda m: (-m.num_blocks, m.worker_id))


class BaseKVStore(ABC):
    """The directory and the prefix index; see the module docstring for the contract."""

    @abstractmethod
    async def register(self, info: WorkerInfo, ttl_ms: int) -> None: ...

    @abstractmethod
    async def deregister(self, worker_id: str) -> bool:
        """Drop the worker and its index state; False if it was not registered."""

    @abstractmethod
    async def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool: ...

    @abstractmethod
    async def list_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Live workers of ``role`` (None: all), by worker id."""

    @abstractmethod
    async def publish(self, worker_id: str, events: Sequence[KVEvent]) -> PublishResult: ...

    @abstractmethod
    async def lookup_prefix(
        self, block_hashes: Sequence[bytes], role: Role | None = None
    ) -> list[PrefixMatch]: ...

    @abstractmethod
    async def ping(self) -> None:
        """Raise ``StoreUnavailableError`` if the store cannot be reached."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections; the store is unusable afterwards."""


def create_store(url: str | None) -> BaseKVStore:
    """``None``/``""``/``memory://``: a ``MemoryStore``; ``redis://``, ``rediss://``,
    ``unix://``: a ``RedisStore``."""
    if not url or url == "memory://":
        return MemoryStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from baton_kvstore.redis_store import RedisStore

        return RedisStore(url)
    raise InvalidRequestError(f"unsupported store URL {url!r} (expected redis://...)")


@dataclass
class _Registration:
    info: WorkerInfo
    ttl_s: float
    deadline: float  # on the store's clock


class MemoryStore(BaseKVStore):
    """Everything in this process's memory; expired workers are dropped on the next call."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._workers: dict[str, _Registration] = {}
        self._blocks: dict[str, set[bytes]] = {}  # worker_id -> block hashes it caches
        self._last_seq: dict[str, int] = {}  # worker_id -> seq of the last applied event

    def __str__(self) -> str:
        return "memory store"

    def _expire(self) -> None:
        now = self._clock()
        for worker_id in [w for w, r in self._workers.items() if r.deadline <= now]:
            self._drop(worker_id)

    def _drop(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._blocks.pop(worker_id, None)
        self._last_seq.pop(worker_id, None)

    async def register(self, info: WorkerInfo, ttl_ms: int) -> None:
        check_ttl(ttl_ms)
        self._drop(info.worker_id)
        ttl_s = ttl_ms / 1000
        self._workers[info.worker_id] = _Registration(info, ttl_s, self._clock() + ttl_s)

    async def deregister(self, worker_id: str) -> bool:
        self._expire()
        known = worker_id in self._workers
        self._drop(worker_id)
        return known

    async def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        self._expire()
        reg = self._workers.get(worker_id)
        if reg is None:
            return False
        reg.info = replace(reg.info, load=load)
        reg.deadline = self._clock() + reg.ttl_s
        return True

    async def list_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        self._expire()
        infos = (r.info for r in self._workers.values())
        return sorted((i for i in infos if role in (None, i.role)), key=lambda i: i.worker_id)

    async def publish(self, worker_id: str, events: Sequence[KVEvent]) -> PublishResult:
        self._expire()
        if worker_id not in self._workers:
            return PublishResult(True, 0)
        plan = plan_batch(self._last_seq.get(worker_id), events)
        if plan is None:
            return PublishResult(True, 0)
        blocks = self._blocks.setdefault(worker_id, set())
        for event in plan:
            if event.kind == "cleared":
                blocks.clear()
            elif event.kind == "stored":
                blocks.update(event.block_hashes)
            else:
                blocks.difference_update(event.block_hashes)
            self._last_seq[worker_id] = event.seq
        return PublishResult(False, len(plan))

    async def lookup_prefix(
        self, block_hashes: Sequence[bytes], role: Role | None = None
    ) -> list[PrefixMatch]:
        matches = []
        for info in await self.list_workers(role):
            blocks = self._blocks.get(info.worker_id, set())
            matches.append(PrefixMatch(info.worker_id, leading(h in blocks for h in block_hashes)))
        return ranked(matches)

    async def ping(self) -> None:
        pass

    async def close(self) -> None:
        pass


# Extends a live record (and its index keys) by its own TTL and records the load; 0 if gone.
