"""Clients of the kvstore: ``KVStoreClient`` (one call per RPC) and ``WorkerRegistration`` (a
worker's background task that keeps it registered and its KV events flowing).

Use both from one asyncio loop; the gRPC channel is opened on the first call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

import grpc

from baton.v1 import kvstore_pb2_grpc
from baton_engine.errors import BatonError
from baton_kvstore import codec
from baton_kvstore.codec import EventKind, KVEvent, PrefixMatch, Role, WorkerInfo, WorkerLoad

logger = logging.getLogger(__name__)

_EVENT_KINDS: tuple[EventKind, ...] = ("stored", "removed", "cleared")


class CacheChange(Protocol):
    """What ``take_events`` may return besides ``(kind, block_hash)`` pairs: the engine's
    ``KVCacheEvent`` fits."""

    @property
    def kind(self) -> str: ...

    @property
    def hash_value(self) -> bytes: ...


Change = tuple[str, bytes] | CacheChange


class KVStoreError(BatonError):
    """A kvstore call failed; ``code`` is its gRPC status (UNAVAILABLE: try again later)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class KVStoreClient:
    """The kvstore at ``address``; every call raises ``KVStoreError`` on failure."""

    def __init__(self, address: str, *, timeout_s: float = 5.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    async def _call(self, method: str, request: Any) -> Any:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
            self._stub = kvstore_pb2_grpc.KVStoreServiceStub(self._channel)  # type: ignore[no-untyped-call]
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise KVStoreError(
                e.code(), f"kvstore {self.address}: {method}: {e.code().name}: {e.details()}"
            ) from e

    async def register(self, info: WorkerInfo, ttl_ms: int) -> None:
        """Register (or re-register) ``info``, live for ``ttl_ms`` unless heartbeats extend it.
        Resets the worker's index state: its next publish must start with CLEARED."""
        await self._call("RegisterWorker", codec.register_request(info, ttl_ms))

    async def heartbeat(self, worker_id: str, load: WorkerLoad | None = None) -> bool:
        """Extend the registration; False: it is gone, register again."""
        request = codec.heartbeat_request(worker_id, load or WorkerLoad())
        return codec.known_from_proto(await self._call("Heartbeat", request))

    async def list_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        response = await self._call("ListWorkers", codec.list_workers_request(role))
        return codec.workers_from_proto(response)

    async def lookup_prefix(
        self, block_hashes: Sequence[bytes], role: Role | None = None
    ) -> list[PrefixMatch]:
        """Every live worker of ``role`` with the number of leading ``block_hashes`` it caches,
        most first."""
        response = await self._call("LookupPrefix", codec.lookup_request(block_hashes, role))
        return codec.matches_from_proto(response)

    async def publish(self, worker_id: str, events: Sequence[KVEvent]) -> bool:
        """Publish KV events; True means resync_required (nothing was applied)."""
        response = await self._call("PublishKVEvents", codec.publish_request(worker_id, events))
        return codec.resync_required_from_proto(response)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class WorkerRegistration:
    """A worker's presence in the kvstore, kept up by one asyncio task (``start``/``stop``).

    - Registers ``info`` (with the current ``load()``), then heartbeats every ``ttl_ms / 3``;
      registers again when a heartbeat answers known=False or after the kvstore was unreachable.
    - Every ``publish_interval_s`` drains ``take_events()`` (``(kind, block_hash)`` pairs or the
      engine's ``KVCacheEvent``s, kind ``"stored"``/``"removed"``, in the order they happened),
      groups runs of one kind into events numbered with a per-worker seq, and publishes them.
    - Resync: after each registration, after ``resync_required``, and after any failed publish
      (the kvstore may or may not have applied it), the next successful contact sends CLEARED then
      STORED with ``snapshot()`` (every hash the worker caches now). Events drained before the
      snapshot are dropped (it covers them); later ones are published on top of it. A refused
      resync means the kvstore forgot the worker (it restarted): it registers again at once.
    - Never raises into the worker: failures are logged once per outage and retried with
      exponential backoff up to ``max_backoff_s``.

    The callbacks run on the loop, so they must be cheap and safe to call from it.
    """

    def __init__(
        self,
        client: KVStoreClient,
        info: WorkerInfo,
        *,
        ttl_ms: int = 6000,
        load: Callable[[], WorkerLoad] | None = None,
        take_events: Callable[[], Sequence[Change]] | None = None,
        snapshot: Callable[[], Sequence[bytes]] | None = None,
        publish_interval_s: float = 0.1,
        max_backoff_s: float = 2.0,
        max_hashes_per_publish: int = 32768,
    ) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms}")
        self.client = client
        self.info = info
        self.ttl_ms = ttl_ms
        self._load = load or WorkerLoad
        self._take_events = take_events
        self._snapshot = snapshot
        self._publish_interval_s = publish_interval_s
        self._max_backoff_s = max_backoff_s
        self._max_hashes = max_hashes_per_publish
        self._task: asyncio.Task[None] | None = None
        self._registered = False
        self._need_resync = True
        self._next_seq = 1
        self._next_heartbeat = 0.0  # loop time
        self._failing = False  # inside an outage (logged once)
        self.num_registrations = 0
        self.num_resyncs = 0

    @property
    def registered(self) -> bool:
        return self._registered

    @property
    def synced(self) -> bool:
        """Registered, with the kvstore's index known to match this worker's cache."""
        return self._registered and (self._take_events is None or not self._need_resync)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kvstore-{self.info.worker_id}")

    async def stop(self) -> None:
        """End the task; the registration then expires with its TTL."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def __aenter__(self) -> WorkerRegistration:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = min(0.1, self._max_backoff_s)
        heartbeat_s = self.ttl_ms / 3000
        while True:
            try:
                await self._step(loop.time(), heartbeat_s)
            except Exception as e:
                self._registered = False
                self._need_resync = True
                if not self._failing:
                    self._failing = True
                    if isinstance(e, KVStoreError):
                        logger.warning("%s; retrying in the background", e)
                    else:
                        logger.exception("kvstore registration failed; retrying in the background")
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, self._max_backoff_s)
                continue
            if self._failing:
                self._failing = False
                logger.info("kvstore %s reachable again; worker re-registered", self.client.address)
            backoff = min(0.1, self._max_backoff_s)
            wait = self._next_heartbeat - loop.time()
            if self._take_events is not None:
                wait = min(wait, self._publish_interval_s)
            await asyncio.sleep(max(wait, 0.0))

    async def _step(self, now: float, heartbeat_s: float) -> None:
        if self._registered and now >= self._next_heartbeat:
            self._registered = await self.client.heartbeat(self.info.worker_id, self._load())
            self._next_heartbeat = now + heartbeat_s
            if not self._registered:
                logger.info("kvstore forgot worker %s; registering again", self.info.worker_id)
        if not self._registered:
            await self.client.register(replace(self.info, load=self._load()), self.ttl_ms)
            self._registered, self._need_resync = True, True
            self._next_heartbeat = now + heartbeat_s
            self.num_registrations += 1
        if self._take_events is None:
            return
        changes = list(self._take_events())
        if not self._need_resync and changes:
            self._need_resync = True  # until the kvstore confirms it applied them
            self._need_resync = await self._publish(self._number(changes))
        if self._need_resync:
            await self._resync()

    async def _resync(self) -> None:
        hashes = list(self._snapshot()) if self._snapshot is not None else []
        events = [KVEvent(self._next_seq, "cleared")]
        self._next_seq += 1
        events += self._number([("stored", h) for h in hashes])
        self._need_resync = await self._publish(events)
        if self._need_resync:
            # Only a worker missing from the directory has a CLEARED batch refused.
            logger.info("kvstore forgot worker %s; registering again", self.info.worker_id)
            self._registered = False
        else:
            self.num_resyncs += 1
            logger.info("resynced %d cached blocks with the kvstore", len(hashes))

    async def _publish(self, events: Sequence[KVEvent]) -> bool:
        """Publish in calls of at most ``max_hashes_per_publish`` hashes; True: resync."""
        for batch in self._batches(events):
            if await self.client.publish(self.info.worker_id, batch):
                return True
        return False

    def _number(self, changes: Sequence[Change]) -> list[KVEvent]:
        """Runs of one kind, split at ``max_hashes_per_publish``, numbered from the next seq."""
        events: list[KVEvent] = []
        run: list[bytes] = []
        kind: EventKind | None = None

        def flush() -> None:
            nonlocal run
            if kind is not None and (run or kind == "cleared"):
                events.append(KVEvent(self._next_seq, kind, tuple(run)))
                self._next_seq += 1
            run = []

        for change in changes:
            if isinstance(change, tuple):
                change_kind, block_hash = change
            else:
                change_kind, block_hash = change.kind, change.hash_value
            if change_kind not in _EVENT_KINDS:
                raise ValueError(f"unknown KV event kind {change_kind!r}")
            if change_kind != kind or change_kind == "cleared" or len(run) >= self._max_hashes:
                flush()
                kind = _EVENT_KINDS[_EVENT_KINDS.index(change_kind)]
            if kind != "cleared":
                run.append(block_hash)
        flush()
        return events

    def _batches(self, events: Sequence[KVEvent]) -> Iterator[list[KVEvent]]:
        batch: list[KVEvent] = []
        num_hashes = 0
        for event in events:
            if batch and num_hashes + len(event.block_hashes) > self._max_hashes:
                yield batch
                batch, num_hashes = [], 0
            batch.append(event)
            num_hashes += len(event.block_hashes)
        if batch:
            yield batch
