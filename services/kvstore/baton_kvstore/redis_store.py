"""``RedisStore``: the kvstore's state in Redis, behaving exactly as ``MemoryStore`` (see
``store.py`` for the semantics both implement)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from baton_kvstore import codec
from baton_kvstore.codec import KVEvent, PrefixMatch, Role, WorkerInfo, WorkerLoad
from baton_kvstore.store import (
    BaseKVStore,
    PublishResult,
    StoreUnavailableError,
    check_ttl,
    leading,
    plan_batch,
    ranked,
)

_HEARTBEAT_LUA = """
local ttl = redis.call('HGET', KEYS[1], 'ttl_ms')
if not ttl then return 0 end
redis.call('HSET', KEYS[1], 'load', ARGV[1])
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ttl) end
return 1
"""
# KEYS: the worker id set, then (record, blocks, seq) per id in ARGV; drops ids whose record is
# gone. Atomic, so a worker registering meanwhile is never dropped.
_PRUNE_LUA = """
for i, id in ipairs(ARGV) do
  local base = 1 + 3 * (i - 1)
  if redis.call('EXISTS', KEYS[base + 1]) == 0 then
    redis.call('SREM', KEYS[1], id)
    redis.call('DEL', KEYS[base + 2], KEYS[base + 3])
  end
end
return 0
"""
_OUTAGE_ERRORS = (rexc.ConnectionError, rexc.TimeoutError, rexc.ReadOnlyError, OSError)
_MAX_WATCH_RETRIES = 16
_SADD_CHUNK = 8192  # members per SADD/SREM command


class RedisStore(BaseKVStore):
    """The same state in Redis, under ``key_prefix``:

    - ``workers``: set of registered worker ids (pruned lazily of expired ones)
    - ``worker:<id>``: hash {info: WorkerInfo proto, load: WorkerLoad proto, ttl_ms}, with PX TTL
    - ``blocks:<id>``: set of the block hashes the worker caches; ``seq:<id>``: its last applied
      event seq. Both carry the record's TTL, refreshed by heartbeats and publishes.
    - ``events``: stream of applied batches {worker_id, first_seq, last_seq, events (a
      PublishKVEventsRequest proto)}, trimmed to about ``event_log_maxlen`` entries.
    """

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "baton:kvstore:",
        event_log_maxlen: int = 10_000,
        timeout_s: float = 2.0,
    ) -> None:
        # One quick retry reconnects after a Redis restart; longer outages fail fast.
        retry = Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1)
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry
        )
        kwargs = self._redis.connection_pool.connection_kwargs
        self._where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
        self._prefix = key_prefix
        self._maxlen = event_log_maxlen
        self._heartbeat_script = self._redis.register_script(_HEARTBEAT_LUA)
        self._prune_script = self._redis.register_script(_PRUNE_LUA)

    def __str__(self) -> str:
        return f"redis store at {self._where}"

    @contextmanager
    def _available(self) -> Iterator[None]:
        try:
            yield
        except _OUTAGE_ERRORS as e:
            raise StoreUnavailableError(f"Redis at {self._where} is unavailable: {e}") from e

    def _keys(self, worker_id: str) -> tuple[str, str, str]:
        p = self._prefix
        return f"{p}worker:{worker_id}", f"{p}blocks:{worker_id}", f"{p}seq:{worker_id}"

    @property
    def events_key(self) -> str:
        return f"{self._prefix}events"

    async def register(self, info: WorkerInfo, ttl_ms: int) -> None:
        check_ttl(ttl_ms)
        record, blocks, seq = self._keys(info.worker_id)
        fields: dict[str, bytes | int] = {
            "info": codec.encode_worker_info(info),
            "load": codec.encode_load(info.load),
            "ttl_ms": ttl_ms,
        }
        with self._available():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(record, blocks, seq)
                pipe.hset(record, mapping=fields)  # type: ignore[arg-type]
                pipe.pexpire(record, ttl_ms)
                pipe.sadd(f"{self._prefix}workers", info.worker_id)
                await pipe.execute()

    async def deregister(self, worker_id: str) -> bool:
        with self._available():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(*self._keys(worker_id))
                pipe.srem(f"{self._prefix}workers", worker_id)
                num_deleted, _ = await pipe.execute()
        return bool(num_deleted)

    async def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        with self._available():
            known = await self._heartbeat_script(
                keys=list(self._keys(worker_id)), args=[codec.encode_load(load)]
            )
        return bool(known)

    async def list_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        with self._available():
            members = await self._redis.smembers(f"{self._prefix}workers")
            ids = sorted(m.decode() if isinstance(m, bytes) else m for m in members)
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker_id in ids:
                    pipe.hmget(self._keys(worker_id)[0], ["info", "load"])
                rows = await pipe.execute()
            gone = [w for w, (info, _) in zip(ids, rows, strict=True) if info is None]
            if gone:
                keys = [k for w in gone for k in self._keys(w)]
                await self._prune_script(keys=[f"{self._prefix}workers", *keys], args=gone)
        infos = []
        for info_bytes, load_bytes in rows:
            if info_bytes is None:
                continue
            info = codec.decode_worker_info(info_bytes)
            if role in (None, info.role):
                load = codec.decode_load(load_bytes or b"")
                infos.append(replace(info, load=load))
        return infos

    async def publish(self, worker_id: str, events: Sequence[KVEvent]) -> PublishResult:
        record, _, seq = self._keys(worker_id)
        with self._available():
            async with self._redis.pipeline(transaction=True) as pipe:
                for _ in range(_MAX_WATCH_RETRIES):
                    try:
                        await pipe.watch(record, seq)
                        ttl_ms = await pipe.hget(record, "ttl_ms")
                        last_seq = await pipe.get(seq)
                        plan = None
                        if ttl_ms is not None:
                            plan = plan_batch(None if last_seq is None else int(last_seq), events)
                        if plan is None:
                            return PublishResult(True, 0)
                        if not plan:
                            return PublishResult(False, 0)
                        pipe.multi()  # type: ignore[no-untyped-call]
                        self._queue_apply(pipe, worker_id, plan, int(ttl_ms))  # type: ignore[arg-type]
                        await pipe.execute()
                        return PublishResult(False, len(plan))
                    except rexc.WatchError:  # a concurrent publish or registration: redo
                        continue
        raise StoreUnavailableError(f"publish for {worker_id}: too much contention, retry")

    def _queue_apply(self, pipe: Any, worker_id: str, plan: Sequence[KVEvent], ttl_ms: int) -> None:
        _, blocks, seq = self._keys(worker_id)
        for event in plan:
            if event.kind == "cleared":
                pipe.delete(blocks)
                continue
            op = pipe.sadd if event.kind == "stored" else pipe.srem
            for i in range(0, len(event.block_hashes), _SADD_CHUNK):
                op(blocks, *event.block_hashes[i : i + _SADD_CHUNK])
        pipe.set(seq, plan[-1].seq, px=ttl_ms)
        pipe.pexpire(blocks, ttl_ms)
        entry = {
            "worker_id": worker_id,
            "first_seq": plan[0].seq,
            "last_seq": plan[-1].seq,
            "events": codec.encode_events(worker_id, plan),
        }
        pipe.xadd(self.events_key, entry, maxlen=self._maxlen, approximate=True)

    async def lookup_prefix(
        self, block_hashes: Sequence[bytes], role: Role | None = None
    ) -> list[PrefixMatch]:
        workers = await self.list_workers(role)
        if not block_hashes or not workers:
            return ranked(PrefixMatch(w.worker_id, 0) for w in workers)
        with self._available():
            async with self._redis.pipeline(transaction=False) as pipe:
                for w in workers:
                    pipe.smismember(self._keys(w.worker_id)[1], list(block_hashes))
                rows = await pipe.execute()
        return ranked(
            PrefixMatch(w.worker_id, leading(row)) for w, row in zip(workers, rows, strict=True)
        )

    async def ping(self) -> None:
        with self._available():
            await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()
