"""KV transfer between two real processes: a source (prefill side) in a spawned child serving
``KVTransferService`` on loopback, the sink (decode side) in the test process. Backends grpc,
NIXL (UCX defaults: CMA) and NIXL over UCX_TLS=tcp; no mocks.

The child is driven over a pipe: grant leases, read what its ``on_free`` saw, move its lease
clock forward. Every child is killed when its test (or the module) ends.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import grpc
import pytest
import torch

from baton_kvtransfer import (
    IncompatiblePeerError,
    KVTransferSink,
    KVTransferSource,
    LeaseTable,
    LeaseUnavailableError,
    TransferFailedError,
    compat_hash,
    nixl_agent,
    resolve_backend,
)
from baton_kvtransfer.blocks import merge_runs, pool_bytes, split_runs
from baton_kvtransfer.metadata import PoolMetadata
from baton_kvtransfer.streaming import ChunkWriter, iter_chunks

try:
    import nixl  # noqa: F401

    HAVE_NIXL = True
except ImportError:
    HAVE_NIXL = False

needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed")
pytestmark = pytest.mark.timeout(30)

POOL_SHAPE = (64, 2, 2, 16, 2, 8)  # blocks, layers, K/V, block_size, kv_heads, head_dim
DTYPE = torch.bfloat16
BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 2
POISON = -7.0
COMPAT = compat_hash("test-model", "bfloat16", 16, "blocks,layers,kv,block_size,kv_heads,dim")
SOURCE_ID = "prefill-0"
START_TIMEOUT_S = 20.0
CALL_TIMEOUT_S = 10.0


def source_pool(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(POOL_SHAPE, generator=g) * 8 + 1).to(DTYPE)  # in [1, 9): never 0


def sink_pool() -> torch.Tensor:
    return torch.full(POOL_SHAPE, POISON, dtype=DTYPE)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# -- the source process ------------------------------------------------------------------------


def run_source(conn: Connection, backend: str, engine_id: str, epoch: int, seed: int) -> None:
    asyncio.run(_serve_source(conn, backend, engine_id, epoch, seed))


async def _serve_source(
    conn: Connection, backend: str, engine_id: str, epoch: int, seed: int
) -> None:
    loop = asyncio.get_running_loop()
    freed: list[tuple[str, str]] = []
    clock_offset = [0.0]
    leases = LeaseTable(
        lambda req_id, reason: freed.append((req_id, reason)),
        clock=lambda: time.monotonic() + clock_offset[0],
    )
    source = KVTransferSource(
        source_pool(seed),
        engine_id=engine_id,
        epoch=epoch,
        compat_hash=COMPAT,
        leases=leases,
        backend=backend,
    )
    server = grpc.aio.server()
    source.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sweeper = asyncio.create_task(leases.run(0.02))
    stop = asyncio.Event()

    def on_command() -> None:
        try:
            cmd, *args = conn.recv()
        except EOFError:  # the test process is gone
            stop.set()
            return
        if cmd == "grant":
            conn.send(leases.grant(args[0], args[1], ttl_s=args[2]).lease_id)
        elif cmd == "freed":
            conn.send(list(freed))
        elif cmd == "advance":
            clock_offset[0] += args[0]
            conn.send(None)
        elif cmd == "handshakes":
            conn.send(source.servicer.num_handshakes)

    loop.add_reader(conn.fileno(), on_command)
    conn.send(port)
    try:
        await stop.wait()
    finally:
        sweeper.cancel()
        await server.stop(None)
        source.close()


@dataclass
class SourceProcess:
    proc: Any  # multiprocessing SpawnProcess
    conn: Connection
    endpoint: str
    engine_id: str
    epoch: int
    seed: int

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError(f"the source process did not answer {cmd[0]}")
        return self.conn.recv()

    def grant(self, req_id: str, block_ids: list[int], ttl_s: float = 30.0) -> str:
        lease_id: str = self.call("grant", req_id, block_ids, ttl_s)
        return lease_id

    def freed(self) -> list[tuple[str, str]]:
        return [tuple(f) for f in self.call("freed")]

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)


@contextmanager
def start_source(
    backend: str, *, engine_id: str = SOURCE_ID, epoch: int = 1, seed: int = 0
) -> Iterator[SourceProcess]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=run_source, args=(child, backend, engine_id, epoch, seed), daemon=True
    )
    proc.start()
    child.close()
    source = SourceProcess(proc, parent, "", engine_id, epoch, seed)
    try:
        if not parent.poll(START_TIMEOUT_S):
            raise TimeoutError("the source process did not start")
        source.endpoint = f"127.0.0.1:{parent.recv()}"
        yield source
    finally:
        source.kill()
        parent.close()


@pytest.fixture(autouse=True)
def ucx_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # no RDMA NICs here; children inherit it


@pytest.fixture(scope="module")
def shared_source() -> Iterator[SourceProcess]:
    """One NIXL source (it serves gRPC sinks too) for the tests that need nothing special."""
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("UCX_NET_DEVICES", "lo")
        with start_source("nixl" if HAVE_NIXL else "grpc", seed=1) as source:
            yield source


def make_sink(pool: torch.Tensor, backend: str, **kwargs: Any) -> KVTransferSink:
    kwargs.setdefault("compat_hash", COMPAT)
    kwargs.setdefault("rpc_timeout_s", 5.0)
    kwargs.setdefault("transfer_timeout_s", 10.0)
    return KVTransferSink(pool, engine_id="decode-0", epoch=7, backend=backend, **kwargs)


async def pull(
    sink: KVTransferSink,
    source: SourceProcess,
    lease_id: str,
    remote: list[int],
    local: list[int],
    lease_expiry_unix_ms: int | None = None,
) -> Any:
    return await sink.pull(
        source.endpoint,
        peer_engine_id=source.engine_id,
        peer_epoch=source.epoch,
        lease_id=lease_id,
        remote_block_ids=remote,
        local_block_ids=local,
        lease_expiry_unix_ms=lease_expiry_unix_ms,
    )


def run_with_sink(
    pool: torch.Tensor, backend: str, body: Callable[[KVTransferSink], Awaitable[Any]], **kw: Any
) -> Any:
    async def main() -> Any:
        sink = make_sink(pool, backend, **kw)
        try:
            return await body(sink)
        finally:
            await sink.close()

    return asyncio.run(main())


class OnCall(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Runs ``hook(request)`` before (or after) every call of one method; a real gRPC
    client interceptor, used to act at an exact point of the pull."""

    def __init__(
        self, method: str, hook: Callable[[Any], Awaitable[None]], after: bool = False
    ) -> None:
        self.method = method
        self.hook = hook
        self.after = after

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        hit = method.endswith("/" + self.method)
        if hit and not self.after:
            await self.hook(request)
        call = await continuation(details, request)
        if hit and self.after:
            await call
            await self.hook(request)
        return call


# -- transfers between processes ------------------------------------------------------------

# Adjacent on both sides (5,6,7 -> 10,11,12 and 12,13 -> 30,31), adjacent on one side only
# (40 -> 2 after 7 -> 12; 63 -> 50 then 0 -> 63) and scattered.
REMOTE = [5, 6, 7, 40, 12, 13, 63, 0]
LOCAL = [10, 11, 12, 2, 30, 31, 50, 63]


@pytest.mark.parametrize(
    ("source_backend", "sink_backend", "ucx_tls", "max_run_blocks"),
    [
        ("grpc", "grpc", None, 0),
        pytest.param("nixl", "nixl", None, 0, marks=needs_nixl),
        pytest.param("nixl", "nixl", "tcp", 0, marks=needs_nixl),
        pytest.param("nixl", "nixl", None, 2, marks=needs_nixl),  # runs cut into descriptors
        pytest.param("nixl", "grpc", None, 0, marks=needs_nixl),  # a gRPC sink ignores NIXL
        pytest.param("grpc", "nixl", None, 0, marks=needs_nixl),  # falls back to gRPC
    ],
)
def test_pull_between_processes(
    source_backend: str,
    sink_backend: str,
    ucx_tls: str | None,
    max_run_blocks: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if ucx_tls is not None:
        monkeypatch.setenv("UCX_TLS", ucx_tls)  # before either agent exists
    monkeypatch.setattr(nixl_agent, "MAX_RUN_BYTES", max_run_blocks * BLOCK_BYTES)
    pool = sink_pool()
    with start_source(source_backend, seed=3) as source:
        lease1 = source.grant("req-1", REMOTE)
        lease2 = source.grant("req-2", [20, 21, 22])

        async def body(sink: KVTransferSink) -> Any:
            first = await pull(sink, source, lease1, REMOTE, LOCAL)
            second = await pull(sink, source, lease2, [20, 21, 22], [40, 42, 41])
            return first, second, sink.num_handshakes

        first, second, num_handshakes = run_with_sink(pool, sink_backend, body)
        assert source.freed() == [("req-1", "released"), ("req-2", "released")]
        assert source.call("handshakes") == 1  # the second pull reused the handshake
    assert num_handshakes == 1
    moved = "nixl" if source_backend == sink_backend == "nixl" else "grpc"
    assert first.backend == second.backend == moved
    assert first.num_bytes == len(REMOTE) * BLOCK_BYTES and first.seconds > 0
    assert second.num_bytes == 3 * BLOCK_BYTES
    expected = source_pool(3)
    assert torch.equal(bits(pool[LOCAL]), bits(expected[REMOTE]))
    assert torch.equal(bits(pool[[40, 42, 41]]), bits(expected[[20, 21, 22]]))
    touched = {*LOCAL, 40, 41, 42}
    untouched = [b for b in range(POOL_SHAPE[0]) if b not in touched]
    assert bool((pool[untouched] == POISON).all())


@pytest.mark.parametrize("backend", ["grpc", pytest.param("nixl", marks=needs_nixl)])
def test_incompatible_peer(shared_source: SourceProcess, backend: str) -> None:
    other = compat_hash("other-model", "bfloat16", 16, "blocks,layers,kv,block_size,kv_heads,dim")
    lease = shared_source.grant("req-compat", [1, 2])
    pool = sink_pool()

    async def body(sink: KVTransferSink) -> None:
        await pull(sink, shared_source, lease, [1, 2], [3, 4])

    with pytest.raises(IncompatiblePeerError) as info:
        run_with_sink(pool, backend, body, compat_hash=other)
    assert "decode-0" in str(info.value) and SOURCE_ID in str(info.value)
    assert bool((pool == POISON).all())
    assert shared_source.call("advance", 0.0) is None  # still serving


@pytest.mark.parametrize("backend", ["grpc", pytest.param("nixl", marks=needs_nixl)])
def test_unknown_or_expired_lease_moves_nothing(shared_source: SourceProcess, backend: str) -> None:
    expired = shared_source.grant("req-expired", [8, 9], ttl_s=0.05)
    time.sleep(0.2)  # the child's sweeper frees it
    assert ("req-expired", "expired") in shared_source.freed()
    pool = sink_pool()

    async def body(sink: KVTransferSink) -> None:
        for lease_id in ("0" * 32, expired):
            with pytest.raises(LeaseUnavailableError):
                await pull(sink, shared_source, lease_id, [8, 9], [8, 9])

    run_with_sink(pool, backend, body)
    assert bool((pool == POISON).all())


@pytest.mark.parametrize("backend", ["grpc", pytest.param("nixl", marks=needs_nixl)])
def test_lease_expiring_before_release_fails_the_pull(
    shared_source: SourceProcess, backend: str
) -> None:
    lease = shared_source.grant("req-late", [30, 31])

    async def expire_all(request: Any) -> None:  # just before ReleaseLease reaches the source
        shared_source.call("advance", 3600.0)

    async def body(sink: KVTransferSink) -> None:
        await pull(sink, shared_source, lease, [30, 31], [0, 1])

    with pytest.raises(LeaseUnavailableError, match="ended before the pull finished"):
        run_with_sink(sink_pool(), backend, body, interceptors=[OnCall("ReleaseLease", expire_all)])
    assert ("req-late", "expired") in shared_source.freed()


@pytest.mark.parametrize("backend", ["grpc", pytest.param("nixl", marks=needs_nixl)])
def test_a_lease_with_time_left_is_read_without_extending_it_first(
    shared_source: SourceProcess, backend: str
) -> None:
    """A pull that does not queue, whose handle's expiry leaves ample time, skips the
    ExtendLease round trip before its read; one close to its expiry extends first. The release
    still confirms every lease: an unknown one fails the pull even with an ample expiry."""
    ample = shared_source.grant("req-ample", [24, 25])
    close = shared_source.grant("req-close", [26, 27])
    extended: list[str] = []

    async def count(request: Any) -> None:
        extended.append(request.lease_id)

    async def body(sink: KVTransferSink) -> None:
        now_ms = int(time.time() * 1000)
        for lease_id, remote, local, expiry in (
            (ample, [24, 25], [0, 1], now_ms + 30_000),
            (close, [26, 27], [2, 3], now_ms + 1_000),
        ):
            await pull(sink, shared_source, lease_id, remote, local, expiry)
        with pytest.raises(LeaseUnavailableError):  # by the stream (gRPC) or the release
            await pull(sink, shared_source, "0" * 32, [28], [4], now_ms + 30_000)

    pool = sink_pool()
    run_with_sink(pool, backend, body, interceptors=[OnCall("ExtendLease", count)])
    assert extended == [close]
    assert {("req-ample", "released"), ("req-close", "released")} <= set(shared_source.freed())
    assert torch.equal(bits(pool[[0, 1, 2, 3]]), bits(source_pool(1)[[24, 25, 26, 27]]))


def test_release_without_pull(shared_source: SourceProcess) -> None:
    lease = shared_source.grant("req-cached", [3])

    async def body(sink: KVTransferSink) -> tuple[bool, bool]:
        first = await sink.release(shared_source.endpoint, lease)
        return first, await sink.release(shared_source.endpoint, lease)

    assert run_with_sink(sink_pool(), "grpc", body) == (True, False)
    assert ("req-cached", "released") in shared_source.freed()


def test_queued_pulls_keep_their_leases(shared_source: SourceProcess) -> None:
    """One slot: the second pull waits ~1.5 s behind the first, longer than its lease's
    0.6 s, and survives because the sink extends it while it waits."""
    first = shared_source.grant("req-first", [10])
    second = shared_source.grant("req-queued", [11], ttl_s=0.6)

    async def hold_first(request: Any) -> None:
        if request.lease_id == first:
            await asyncio.sleep(1.5)

    async def body(sink: KVTransferSink) -> None:
        one = asyncio.create_task(pull(sink, shared_source, first, [10], [10]))
        await asyncio.sleep(0.05)  # the first pull holds the slot
        await pull(sink, shared_source, second, [11], [11])
        await one

    pool = sink_pool()
    run_with_sink(
        pool,
        "grpc",
        body,
        max_concurrent_pulls=1,
        lease_extend_ms=600,
        interceptors=[OnCall("ReleaseLease", hold_first)],
    )
    freed = shared_source.freed()
    assert ("req-queued", "released") in freed and ("req-queued", "expired") not in freed
    assert torch.equal(bits(pool[[10, 11]]), bits(source_pool(1)[[10, 11]]))


def test_a_lease_held_while_a_pull_waits_stays_live(shared_source: SourceProcess) -> None:
    """``hold``: a pull that first waits 1.5 s for something else (a split decode worker
    waits for room to land its blocks) keeps its 0.6 s lease alive meanwhile; the same wait
    without it loses the lease."""
    held = shared_source.grant("req-held", [13], ttl_s=0.6)
    unheld = shared_source.grant("req-unheld", [14], ttl_s=0.6)

    async def body(sink: KVTransferSink) -> None:
        room = asyncio.sleep(1.5, result="room")
        assert await sink.hold(shared_source.endpoint, held, room) == "room"
        await pull(sink, shared_source, held, [13], [13])
        await asyncio.sleep(1.5)
        with pytest.raises(LeaseUnavailableError):
            await pull(sink, shared_source, unheld, [14], [14])

    pool = sink_pool()
    run_with_sink(pool, "grpc", body, lease_extend_ms=600)
    freed = shared_source.freed()
    assert ("req-held", "released") in freed and ("req-held", "expired") not in freed
    assert ("req-unheld", "expired") in freed
    assert torch.equal(bits(pool[[13]]), bits(source_pool(1)[[13]]))


def test_a_hold_that_fails_gives_back_what_its_wait_took(shared_source: SourceProcess) -> None:
    """``hold`` on a lease that is gone raises; a wait that had already finished (rows of a
    staging area taken) has its result given back, and one still pending is cancelled."""
    given: list[object] = []

    async def body(sink: KVTransferSink) -> None:
        done: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        done.set_result([5, 6])
        with pytest.raises(LeaseUnavailableError):
            await sink.hold(shared_source.endpoint, "0" * 32, done, give_back=given.append)
        pending = asyncio.ensure_future(asyncio.sleep(60))
        with pytest.raises(LeaseUnavailableError):
            await sink.hold(shared_source.endpoint, "0" * 32, pending, give_back=given.append)
        await asyncio.sleep(0)
        assert pending.cancelled()

    run_with_sink(sink_pool(), "grpc", body)
    assert given == [[5, 6]]


@pytest.mark.parametrize("backend", ["grpc", pytest.param("nixl", marks=needs_nixl)])
def test_killed_source_fails_fast(backend: str) -> None:
    """SIGKILL between pulls (the handshake is cached) and in the middle of one (after the
    lease check, before the bytes move): TransferFailedError both times, never a hang."""
    with start_source(backend) as first, start_source(backend, engine_id="prefill-1") as second:
        lease1 = first.grant("req-a", [1, 2])
        lease2 = first.grant("req-b", [3])
        lease3 = second.grant("req-c", [4, 5])
        lease4 = second.grant("req-d", [6])

        async def kill_second(request: Any) -> None:
            if request.lease_id == lease4:
                second.kill()

        async def body(sink: KVTransferSink) -> tuple[float, str]:
            await pull(sink, first, lease1, [1, 2], [1, 2])
            await pull(sink, second, lease3, [4, 5], [4, 5])  # handshaken: cached
            first.kill()
            start = time.monotonic()
            with pytest.raises(TransferFailedError):
                await pull(sink, first, lease2, [3], [3])
            with pytest.raises(TransferFailedError) as mid_pull:
                await pull(sink, second, lease4, [6], [6])
            return time.monotonic() - start, str(mid_pull.value)

        elapsed, message = run_with_sink(
            sink_pool(), backend, body, interceptors=[OnCall("ExtendLease", kill_second, True)]
        )
    assert elapsed < 10.0
    assert ("NIXL READ" if backend == "nixl" else "pulling blocks") in message


# -- pieces, in process ----------------------------------------------------------------------


def test_merge_runs() -> None:
    runs = merge_runs(REMOTE, LOCAL)
    assert [tuple(r) for r in runs] == [
        (5, 10, 3),
        (40, 2, 1),
        (12, 30, 2),
        (63, 50, 1),
        (0, 63, 1),
    ]
    assert merge_runs([], []) == []
    with pytest.raises(ValueError):
        merge_runs([1], [])


def test_split_runs() -> None:
    runs = split_runs(merge_runs(REMOTE, LOCAL), 2)
    assert [tuple(r) for r in runs] == [
        (5, 10, 2),
        (7, 12, 1),
        (40, 2, 1),
        (12, 30, 2),
        (63, 50, 1),
        (0, 63, 1),
    ]
    with pytest.raises(ValueError):
        split_runs(runs, 0)


def test_stream_chunks_cross_block_boundaries() -> None:
    src, dst = source_pool(5), sink_pool()
    remote, local = [9, 10, 11, 3, 60], [0, 1, 5, 6, 20]
    num_chunks = 0
    writer = ChunkWriter(pool_bytes(dst), local)
    for offset, data in iter_chunks(pool_bytes(src), remote, 3000):  # not a block multiple
        writer.write(offset, data)
        num_chunks += 1
    writer.finish()
    assert num_chunks == -(-5 * BLOCK_BYTES // 3000)
    assert torch.equal(bits(dst[local]), bits(src[remote]))
    short = ChunkWriter(pool_bytes(dst), [1, 2])
    short.write(0, b"x" * 100)
    with pytest.raises(TransferFailedError):
        short.finish()
    with pytest.raises(TransferFailedError):
        short.write(0, b"x")  # out of order


def test_pool_metadata_roundtrip() -> None:
    meta = PoolMetadata("VRAM", 3, 0x7F00_0000_1000, 1024, 262144, b"\x00agent-blob")
    assert PoolMetadata.decode(meta.encode()) == meta
    assert PoolMetadata.decode(b"") is None
    with pytest.raises(ValueError):
        PoolMetadata.decode(b"nope" + meta.encode()[4:])


def test_compat_hash_is_canonical() -> None:
    a = compat_hash("m", "bfloat16", 16, "l", num_layers=24, head_dim=64)
    assert a == compat_hash("m", "bfloat16", 16, "l", head_dim=64, num_layers=24)
    assert len(a) == 16
    assert a != compat_hash("m", "bfloat16", 32, "l", num_layers=24, head_dim=64)
    assert a != compat_hash("m", "float16", 16, "l", num_layers=24, head_dim=64)


def test_resolve_backend() -> None:
    assert resolve_backend("grpc") == "grpc"
    assert resolve_backend("nixl") == "nixl"
    assert resolve_backend("auto") == ("nixl" if HAVE_NIXL else "grpc")
    with pytest.raises(ValueError):
        resolve_backend("rdma")


_WRITE_FROM_A_THREAD = """
import os, threading, torch
from baton_kvtransfer.blocks import pool_bytes
from baton_kvtransfer.streaming import ChunkWriter
torch.set_num_threads(2)
pool = torch.zeros(64, 1 << 16, dtype=torch.uint8)  # 64 blocks of 64 KiB
writer = ChunkWriter(pool_bytes(pool), list(range(64)))
def write():  # counted on the writing thread: an OpenMP pool's threads outlive the write
    before = len(os.listdir("/proc/self/task"))
    writer.write(0, bytes(range(256)) * (1 << 14))
    print(len(os.listdir("/proc/self/task")) - before)
t = threading.Thread(target=write)
t.start()
t.join()
assert int(pool.view(-1)[:256].sum()) == sum(range(256))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_chunk_writer_starts_no_thread_pool_beside_the_engine() -> None:
    """A worker's event loop writes pulled KV into a DRAM pool; a torch copy there would start an
    OpenMP thread pool for that thread beside the engine thread's (and throttle every pool's
    spinning, see baton_decode.engine_loop.EngineThread). The thread that wrote must leave no
    OS thread behind."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", _WRITE_FROM_A_THREAD], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
