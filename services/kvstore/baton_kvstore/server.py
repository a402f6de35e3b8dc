"""The kvstore's gRPC server: ``KVStoreService`` plus ``grpc.health.v1``.

Status codes: bad input is INVALID_ARGUMENT with the reason; while the store (Redis) cannot be
reached every call is UNAVAILABLE and health turns NOT_SERVING, and the server keeps running.
When Redis comes back after a restart its state is empty: heartbeats answer ``known=False`` and
publishes ``resync_required``, so the workers register again and rebuild the index.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING, in-flight calls get a second to finish,
the store is closed and ``serve`` returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from baton.addresses import grpc_address, url_host
from baton.v1 import kvstore_pb2, kvstore_pb2_grpc
from baton_engine.errors import BatonError, InvalidRequestError
from baton_kvstore import codec
from baton_kvstore.store import BaseKVStore, StoreUnavailableError, create_store

logger = logging.getLogger(__name__)

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"].full_name
_STOP_GRACE_S = 1.0
_T = TypeVar("_T")
_Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


@dataclass(frozen=True)
class KVStoreConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (printed in the ready line)
    redis_url: str | None = None  # None: the in-memory store
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    monitor_interval_s: float = 1.0  # how often store health and the worker gauge are refreshed


class KVStoreMetrics:
    """The kvstore's Prometheus metrics, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.workers = Gauge(
            "baton:kvstore_workers", "Live registered workers", ["role"], registry=self.registry
        )
        self.kv_events = Counter(
            "baton:kvstore_kv_events",
            "KV events applied to the prefix index",
            registry=self.registry,
        )
        self.resyncs = Counter(
            "baton:kvstore_resyncs",
            "PublishKVEvents calls answered with resync_required",
            registry=self.registry,
        )
        self.lookups = Counter(
            "baton:kvstore_lookups", "LookupPrefix calls", registry=self.registry
        )


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServiceServicer):
    """``KVStoreService`` over one store; every method runs on the asyncio loop."""

    def __init__(self, store: BaseKVStore, metrics: KVStoreMetrics, status: StoreStatus) -> None:
        self.store = store
        self.metrics = metrics
        self.status = status

    async def _call(self, context: _Context, fn: Callable[[], Awaitable[_T]]) -> _T:
        try:
            result = await fn()
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except StoreUnavailableError as e:
            await self.status.report(False, str(e))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        else:
            await self.status.report(True)
            return result
        raise AssertionError("context.abort returned")  # it raises; mypy cannot tell

    async def RegisterWorker(
        self, request: kvstore_pb2.RegisterWorkerRequest, context: _Context
    ) -> kvstore_pb2.RegisterWorkerResponse:
        async def run() -> kvstore_pb2.RegisterWorkerResponse:
            info, ttl_ms = codec.register_from_proto(request)
            await self.store.register(info, ttl_ms)
            logger.info(
                "registered %s worker %s at %s", info.role, info.worker_id, info.grpc_address
            )
            return codec.register_response()

        return await self._call(context, run)

    async def Heartbeat(
        self, request: kvstore_pb2.HeartbeatRequest, context: _Context
    ) -> kvstore_pb2.HeartbeatResponse:
        async def run() -> kvstore_pb2.HeartbeatResponse:
            worker_id, load = codec.heartbeat_from_proto(request)
            return codec.heartbeat_response(await self.store.heartbeat(worker_id, load))

        return await self._call(context, run)

    async def ListWorkers(
        self, request: kvstore_pb2.ListWorkersRequest, context: _Context
    ) -> kvstore_pb2.ListWorkersResponse:
        async def run() -> kvstore_pb2.ListWorkersResponse:
            role = codec.list_workers_from_proto(request)
            return codec.list_workers_response(await self.store.list_workers(role))

        return await self._call(context, run)

    async def PublishKVEvents(
        self,
        request: kvstore_pb2.PublishKVEventsRequest,
        context: _Context,
    ) -> kvstore_pb2.PublishKVEventsResponse:
        async def run() -> kvstore_pb2.PublishKVEventsResponse:
            worker_id, events = codec.publish_from_proto(request)
            result = await self.store.publish(worker_id, events)
            self.metrics.kv_events.inc(result.num_applied)
            if result.resync_required:
                self.metrics.resyncs.inc()
                logger.info("asking worker %s to resync its KV events", worker_id)
            return codec.publish_response(result.resync_required)

        return await self._call(context, run)

    async def LookupPrefix(
        self, request: kvstore_pb2.LookupPrefixRequest, context: _Context
    ) -> kvstore_pb2.LookupPrefixResponse:
        async def run() -> kvstore_pb2.LookupPrefixResponse:
            hashes, role = codec.lookup_from_proto(request)
            self.metrics.lookups.inc()
            return codec.lookup_response(await self.store.lookup_prefix(hashes, role))

        return await self._call(context, run)


class StoreStatus:
    """Whether the store answers, as every call and the monitor last saw it: drives the health
    status and logs each outage once."""

    def __init__(self, health: health_aio.HealthServicer) -> None:
        self.health = health
        self.available: bool | None = None  # None: not known yet
        self._lock = asyncio.Lock()

    async def report(self, available: bool, why: str = "") -> None:
        if available == self.available:
            return
        async with self._lock:
            if available == self.available:
                return
            if not available:
                logger.warning("store unavailable, answering UNAVAILABLE until it is back: %s", why)
            elif self.available is False:
                logger.info("store reachable again")
            self.available = available
            status = health_pb2.HealthCheckResponse.NOT_SERVING
            if available:
                status = health_pb2.HealthCheckResponse.SERVING
            for service in ("", SERVICE_NAME):
                await self.health.set(service, status)


async def _probe(store: BaseKVStore, metrics: KVStoreMetrics, status: StoreStatus) -> None:
    """Check the store even when no calls come in, and refresh the worker gauge."""
    try:
        workers = await store.list_workers()
    except StoreUnavailableError as e:
        await status.report(False, str(e))
        return
    await status.report(True)
    for role in codec.ROLES:
        metrics.workers.labels(role).set(sum(w.role == role for w in workers))


async def _monitor(
    store: BaseKVStore, metrics: KVStoreMetrics, status: StoreStatus, interval_s: float
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await _probe(store, metrics, status)


def serve(config: KVStoreConfig) -> int:
    """Serve until SIGTERM/SIGINT and return the exit status (0).

    Prints ``baton kvstore ready on HOST:PORT (STORE[, metrics URL])`` on stdout once it serves;
    launchers wait for that line. Raises ``BatonError`` if a port cannot be bound or the store URL
    is not supported. Redis being down at start is not an error: calls answer UNAVAILABLE.
    """
    return asyncio.run(_serve(config))


async def _serve(config: KVStoreConfig) -> int:
    store = create_store(config.redis_url)
    metrics = KVStoreMetrics()
    httpd = None
    where = str(store)
    if config.metrics_port is not None:
        try:
            httpd, _ = start_http_server(
                config.metrics_port, addr=config.host, registry=metrics.registry
            )
        except OSError as e:
            await store.close()
            raise BatonError(f"cannot serve metrics on port {config.metrics_port}: {e}") from e
        where += f", metrics http://{url_host(config.host)}:{httpd.server_port}/metrics"

    health = health_aio.HealthServicer()
    status = StoreStatus(health)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    # The generated *_pb2_grpc module is untyped.
    kvstore_pb2_grpc.add_KVStoreServiceServicer_to_server(  # type: ignore[no-untyped-call]
        KVStoreServicer(store, metrics, status), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = grpc_address(config.host, config.port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        if httpd is not None:
            httpd.shutdown()
        await store.close()
        raise BatonError(f"cannot listen on {address}: {e}") from e

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    monitor = None
    try:
        await _probe(store, metrics, status)
        await server.start()
        monitor = asyncio.create_task(_monitor(store, metrics, status, config.monitor_interval_s))
        print(f"baton kvstore ready on {grpc_address(config.host, port)} ({where})", flush=True)
        await stop.wait()
        logger.info("shutting down")
        await health.enter_graceful_shutdown()
        await server.stop(_STOP_GRACE_S)
    finally:
        if monitor is not None:
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
        await store.close()
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
    logger.info("kvstore stopped")
    return 0
