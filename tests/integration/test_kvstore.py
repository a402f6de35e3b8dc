"""``baton kvstore`` as a real process on loopback, driven through ``KVStoreClient`` and
``WorkerRegistration``; with Redis, a real redis-server that the tests kill and restart."""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families

from baton.v1 import kvstore_pb2, kvstore_pb2_grpc
from baton_engine.kv_cache.block_pool import KVCacheEvent
from baton_engine.kv_cache.hashing import hash_request_tokens
from baton_kvstore.client import KVStoreClient, KVStoreError, WorkerRegistration
from baton_kvstore.codec import KVEvent, PrefixMatch, WorkerInfo, WorkerLoad

pytestmark = pytest.mark.integration

READY = re.compile(r"baton kvstore ready on (\S+) \((.*)\)")
METRICS = re.compile(r"metrics (\S+)")
TEST_TIMEOUT_S = 20.0
_T = TypeVar("_T")


@dataclass
class KVStoreProcess:
    proc: subprocess.Popen[str]
    address: str
    metrics_url: str | None
    log_path: Path

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:]


def start_kvstore(log_path: Path, *extra: str, port: int = 0) -> KVStoreProcess:
    cmd = [sys.executable, "-m", "baton.cli", "kvstore", "--port", str(port), *extra]
    log = log_path.open("a")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:  # keeps draining stdout so the server can never block on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            match = READY.search(lines.get(timeout=0.2))
        except queue.Empty:
            match = None
            if proc.poll() is not None:
                break
        if match:
            metrics = METRICS.search(match.group(2))
            return KVStoreProcess(
                proc, match.group(1), metrics.group(1) if metrics else None, log_path
            )
    stop_kvstore(proc)
    pytest.fail(f"the kvstore did not start:\n{log_path.read_text()[-3000:]}")


def stop_kvstore(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.fixture
def kvstore(tmp_path: Path) -> Iterator[KVStoreProcess]:
    server = start_kvstore(tmp_path / "kvstore.log", "--metrics-port", "0")
    yield server
    stop_kvstore(server.proc)


def run(body: Callable[[], Awaitable[_T]]) -> _T:
    async def main() -> _T:
        return await asyncio.wait_for(body(), TEST_TIMEOUT_S)

    return asyncio.run(main())


def chain(num_blocks: int, seed: int = 0) -> list[bytes]:
    tokens = [seed * 100_000 + i for i in range(16 * num_blocks)]
    return [h.hash_value for h in hash_request_tokens(tokens, 16)]


def info(worker_id: str, role: Any = "decode") -> WorkerInfo:
    return WorkerInfo(worker_id, role, "127.0.0.1:1234", num_blocks=64, block_size=16)


@dataclass
class WorkerCache:
    """What a worker's block pool reports to ``WorkerRegistration``: its hashes and its events,
    as ``(kind, hash)`` pairs or as the engine's ``KVCacheEvent``s."""

    engine_events: bool = False
    blocks: set[bytes] = field(default_factory=set)
    events: list[Any] = field(default_factory=list)

    def _event(self, kind: str, block_hash: bytes) -> Any:
        return KVCacheEvent(kind, block_hash) if self.engine_events else (kind, block_hash)

    def store(self, hashes: list[bytes]) -> None:
        self.blocks.update(hashes)
        self.events += [self._event("stored", h) for h in hashes]

    def remove(self, hashes: list[bytes]) -> None:
        self.blocks.difference_update(hashes)
        self.events += [self._event("removed", h) for h in hashes]

    def take_events(self) -> list[Any]:
        events, self.events = self.events, []
        return events

    def snapshot(self) -> list[bytes]:
        return list(self.blocks)


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await check():
                return
        except KVStoreError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def matches_of(client: KVStoreClient, hashes: list[bytes]) -> dict[str, int]:
    return {m.worker_id: m.num_blocks for m in await client.lookup_prefix(hashes)}


def health_status(address: str) -> Any:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def test_directory_and_index_over_grpc(kvstore: KVStoreProcess) -> None:
    prompt = chain(6)

    async def body() -> None:
        async with KVStoreClient(kvstore.address) as client:
            await client.register(info("d1"), 10_000)
            await client.register(info("p1", "prefill"), 10_000)
            assert await client.heartbeat("d1", WorkerLoad(2, 1, 0.5, 8))
            assert not await client.heartbeat("nobody")
            workers = await client.list_workers()
            assert [w.worker_id for w in workers] == ["d1", "p1"]
            assert workers[0].load == WorkerLoad(2, 1, 0.5, 8)
            assert [w.worker_id for w in await client.list_workers("prefill")] == ["p1"]

            assert await client.publish("d1", [KVEvent(1, "stored", tuple(prompt))])  # unknown
            events = [KVEvent(1, "cleared"), KVEvent(2, "stored", tuple(prompt[:4]))]
            assert not await client.publish("d1", events)
            assert not await client.publish("p1", [KVEvent(7, "cleared")])
            assert not await client.publish("p1", [KVEvent(8, "stored", tuple(prompt))])
            assert await client.lookup_prefix(prompt) == [
                PrefixMatch("p1", 6),
                PrefixMatch("d1", 4),
            ]
            assert await client.lookup_prefix(prompt, "decode") == [PrefixMatch("d1", 4)]
            assert await client.publish("d1", [KVEvent(4, "removed", (prompt[0],))])  # gap
            assert not await client.publish("d1", [KVEvent(3, "removed", (prompt[1],))])
            assert await client.lookup_prefix(prompt, "decode") == [PrefixMatch("d1", 1)]

    run(body)
    assert health_status(kvstore.address) == health_pb2.HealthCheckResponse.SERVING
    assert kvstore.metrics_url is not None
    time.sleep(1.2)  # the worker gauge is refreshed every second
    metrics = scrape(kvstore.metrics_url)
    assert metrics["baton:kvstore_workers{role=decode}"] == 1
    assert metrics["baton:kvstore_workers{role=prefill}"] == 1
    assert metrics["baton:kvstore_kv_events_total{}"] == 5
    assert metrics["baton:kvstore_resyncs_total{}"] == 2
    assert metrics["baton:kvstore_lookups_total{}"] == 3
    assert stop_kvstore(kvstore.proc, signal.SIGINT) == 0


def test_bad_input_is_invalid_argument(kvstore: KVStoreProcess) -> None:
    with grpc.insecure_channel(kvstore.address) as channel:
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)  # type: ignore[no-untyped-call]
        good = kvstore_pb2.WorkerInfo(worker_id="w", role=1, grpc_address="127.0.0.1:1")
        calls = [
            (stub.RegisterWorker, kvstore_pb2.RegisterWorkerRequest(worker=good), "ttl_ms"),
            (
                stub.RegisterWorker,
                kvstore_pb2.RegisterWorkerRequest(
                    worker=kvstore_pb2.WorkerInfo(role=1, grpc_address="x:1"), ttl_ms=100
                ),
                "worker_id must not be empty",
            ),
            (
                stub.RegisterWorker,
                kvstore_pb2.RegisterWorkerRequest(
                    worker=kvstore_pb2.WorkerInfo(worker_id="w", grpc_address="x:1"), ttl_ms=100
                ),
                "role",
            ),
            (stub.Heartbeat, kvstore_pb2.HeartbeatRequest(), "worker_id must not be empty"),
            (stub.ListWorkers, kvstore_pb2.ListWorkersRequest(role=9), "role"),
            (
                stub.PublishKVEvents,
                kvstore_pb2.PublishKVEventsRequest(
                    worker_id="w",
                    events=[
                        kvstore_pb2.KVEvent(seq=1, kind=3),
                        kvstore_pb2.KVEvent(seq=5, kind=1, block_hashes=[b"x"]),
                    ],
                ),
                "grow by 1",
            ),
            (
                stub.PublishKVEvents,
                kvstore_pb2.PublishKVEventsRequest(worker_id="w", events=[kvstore_pb2.KVEvent()]),
                "event kind",
            ),
            (stub.LookupPrefix, kvstore_pb2.LookupPrefixRequest(block_hashes=[b""]), "hash"),
        ]
        stub.RegisterWorker(kvstore_pb2.RegisterWorkerRequest(worker=good, ttl_ms=10_000))
        for method, request, message in calls:
            with pytest.raises(grpc.RpcError) as exc_info:
                method(request, timeout=5)
            error: Any = exc_info.value
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert message in error.details()


def test_worker_registration_publishes_and_survives_a_kvstore_restart(tmp_path: Path) -> None:
    """Memory store: the kvstore itself restarts (state lost); the worker re-registers."""
    port = free_port()
    log_path = tmp_path / "kvstore.log"
    server = start_kvstore(log_path, port=port)
    prompt = chain(8)
    cache = WorkerCache(engine_events=True)

    async def body() -> None:
        nonlocal server
        client = KVStoreClient(server.address, timeout_s=1.0)
        registration = WorkerRegistration(
            client,
            info("w1"),
            ttl_ms=600,
            load=lambda: WorkerLoad(num_running=len(cache.blocks)),
            take_events=cache.take_events,
            snapshot=cache.snapshot,
            publish_interval_s=0.05,
            max_backoff_s=0.5,
            max_hashes_per_publish=2,  # resyncs and bursts take several calls
        )
        async with client, registration:
            cache.store(prompt[:3])
            await wait_for(
                lambda: _equals(matches_of(client, prompt), {"w1": 3}), 5, "the first blocks"
            )
            cache.store(prompt[3:])
            cache.remove(prompt[5:6])
            await wait_for(lambda: _equals(matches_of(client, prompt), {"w1": 5}), 5, "events")
            await asyncio.sleep(1.5)  # heartbeats (every 200 ms) keep the 600 ms TTL alive
            assert (await client.list_workers())[0].load.num_running == 7
            assert registration.num_registrations == 1

            time.sleep(0.8)  # the worker stalls past its TTL: known=False, register, resync
            await wait_for(lambda: _equals(matches_of(client, prompt), {"w1": 5}), 5, "re-register")
            assert registration.num_registrations == 2

            assert stop_kvstore(server.proc) == 0
            cache.store(prompt[5:6])  # happens while the kvstore is gone
            await asyncio.sleep(0.5)
            assert not registration.registered
            server = start_kvstore(log_path, port=port)
            await wait_for(lambda: _equals(matches_of(client, prompt), {"w1": 8}), 8, "the resync")
            assert registration.num_registrations == 3
            assert registration.synced

    try:
        run(body)
    finally:
        stop_kvstore(server.proc)


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return bool(await value == expected)


def test_redis_outage_is_unavailable_then_workers_resync(
    tmp_path: Path, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_kvstore(tmp_path / "kvstore.log", "--redis-url", redis_server.url)
    prompt = chain(6)
    cache = WorkerCache()
    cache.store(prompt[:4])

    async def body() -> None:
        client = KVStoreClient(server.address, timeout_s=2.0)
        registration = WorkerRegistration(
            client,
            info("w1"),
            ttl_ms=3000,
            take_events=cache.take_events,
            snapshot=cache.snapshot,
            publish_interval_s=0.05,
            max_backoff_s=0.5,
        )
        async with client, registration:
            await wait_for(lambda: _equals(matches_of(client, prompt), {"w1": 4}), 5, "snapshot")
            redis_server.stop()
            for call in (client.list_workers(), client.lookup_prefix(prompt)):
                with pytest.raises(KVStoreError) as exc_info:
                    await call
                assert exc_info.value.code == grpc.StatusCode.UNAVAILABLE
                assert "unavailable" in str(exc_info.value)
            # The failed calls already turned health NOT_SERVING; the server is still up.
            status = await asyncio.to_thread(health_status, server.address)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert server.proc.poll() is None
            cache.store(prompt[4:5])

            async def noticed() -> bool:
                return not registration.registered

            await wait_for(noticed, 5, "the worker to notice the outage")
            await asyncio.sleep(1.0)  # it keeps retrying meanwhile
            redis_server.start()  # empty: every registration and index entry is gone
            await wait_for(lambda: _equals(matches_of(client, prompt), {"w1": 5}), 8, "resync")
            assert registration.num_registrations >= 2
            outage_logs = [
                r
                for r in caplog.records
                if r.name == "baton_kvstore.client" and r.levelno >= logging.WARNING
            ]
            assert len(outage_logs) == 1, outage_logs  # once per outage, not per retry
            assert registration.num_resyncs >= 2
            status = await asyncio.to_thread(health_status, server.address)
            assert status == health_pb2.HealthCheckResponse.SERVING

            # A restart too quick for the worker to see: its next publish or heartbeat finds it
            # forgotten, and it registers and resyncs again.
            redis_server.restart()
            assert await client.lookup_prefix(prompt) == []
            cache.store(prompt[5:6])
            await wait_for(lambda: _equals(matches_of(client, prompt), {"w1": 6}), 5, "resync 2")

    try:
        run(body)
    finally:
        assert stop_kvstore(server.proc) == 0
    assert "store unavailable" in server.log_tail()
