"""The sink (decode) side: pull leased blocks from a source worker into this worker's pool.

One pull::

    handshake (once per peer engine id and epoch; cached) -> a BlockReader for the peer
      -> wait for one of ``max_concurrent_pulls`` slots, extending the lease every third of
         ``lease_extend_ms`` while queued
      -> ExtendLease (the lease is still live, and stays so for ``lease_extend_ms``), unless
         the pull did not queue and the handle's expiry leaves more than
         ``SKIP_EXTEND_MARGIN_S``: the release below confirms the lease all the same
      -> move the bytes: NIXL READ from the source's registered pool, or the PullBlocks stream
      -> ReleaseLease: released=False means the lease ended before now, so the blocks may
         have been freed and reused during the move: LeaseUnavailableError, nothing usable

Every failure is a ``KVTransferError``; the caller then recomputes the prompt (or fails the
request). The local blocks named in a failed pull may hold partial data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import grpc
import torch

from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from baton_kvtransfer.blocks import block_bytes, check_block_ids, check_pool, pool_bytes
from baton_kvtransfer.errors import (
    IncompatiblePeerError,
    KVTransferError,
    LeaseUnavailableError,
    TransferFailedError,
    error_from_rpc,
)
from baton_kvtransfer.metadata import PoolMetadata
from baton_kvtransfer.nixl_agent import NixlAgent, NixlBlockReader, agent_name, resolve_backend
from baton_kvtransfer.streaming import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, GrpcBlockReader

logger = logging.getLogger(__name__)
# A pull whose lease (by the handle's expiry) has more than this left skips the ExtendLease
# round trip before its read (~0.5 ms on loopback).
SKIP_EXTEND_MARGIN_S = 5.0
T = TypeVar("T")


class BlockReader(Protocol):
    """Moves blocks from one peer's pool into ours (the lease is the caller's business)."""

    @property
    def name(self) -> str: ...  # the backend: "nixl" or "grpc"

    async def read(self, lease_id: str, remote: list[int], local: list[int]) -> int: ...

    def close(self) -> None: ...


class PullResult(NamedTuple):
    num_bytes: int
    seconds: float  # from getting a slot to the release (queueing excluded)
    backend: str  # the transport that moved the bytes: "nixl" or "grpc"
    read_seconds: float  # moving the bytes alone (without the lease RPCs around it)


@dataclass(frozen=True)
class _Peer:
    engine_id: str
    epoch: int
    reader: BlockReader


class KVTransferSink:
    def __init__(
        self,
        pool: torch.Tensor,
        *,
        engine_id: str,
        epoch: int,
        compat_hash: bytes,
        backend: str = "grpc",
        max_concurrent_pulls: int = 4,
        lease_extend_ms: int = 10_000,
        rpc_timeout_s: float = 10.0,
        transfer_timeout_s: float = 60.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        """``backend``: "nixl", "grpc" or "auto" (see ``resolve_backend``); a NIXL sink
        registers ``pool`` now. ``interceptors`` go on every channel it opens (tracing)."""
        check_pool(pool)
        if max_concurrent_pulls < 1:
            raise ValueError(f"max_concurrent_pulls must be >= 1: {max_concurrent_pulls}")
        self.engine_id = engine_id
        self.epoch = epoch
        self.compat_hash = compat_hash
        self.backend = resolve_backend(backend)
        self.lease_extend_ms = lease_extend_ms
        self.rpc_timeout_s = rpc_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.chunk_bytes = chunk_bytes
        self.interceptors = list(interceptors)
        self.num_blocks = pool.shape[0]
        self.block_bytes = block_bytes(pool)
        self._pool_bytes = pool_bytes(pool)
        self.agent: NixlAgent | None = None
        if self.backend == "nixl":
            self.agent = NixlAgent(agent_name(engine_id, "sink"), pool)
        self._metadata = self.agent.metadata().encode() if self.agent is not None else b""
        self._slots = asyncio.Semaphore(max_concurrent_pulls)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: dict[tuple[str, int], asyncio.Task[_Peer]] = {}  # (engine id, epoch)
        self._grpc_fallbacks_logged: set[str] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self.num_handshakes = 0

    async def pull(
        self,
        endpoint: str,
        *,
        peer_engine_id: str,
        peer_epoch: int,
        lease_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        lease_expiry_unix_ms: int | None = None,
    ) -> PullResult:
        """Copy the peer's ``remote_block_ids`` into this pool's ``local_block_ids`` (pairwise)
        under ``lease_id``, then release the lease. ``lease_expiry_unix_ms`` (the handle's)
        lets a pull with ample time left skip extending the lease first. Raises
        ``IncompatiblePeerError``, ``LeaseUnavailableError`` or ``TransferFailedError``;
        ``ValueError`` for bad ids."""
        remote, local = list(remote_block_ids), list(local_block_ids)
        if len(remote) != len(local):
            raise ValueError(f"{len(remote)} remote blocks but {len(local)} local blocks")
        check_block_ids(local, self.num_blocks, "local")
        if len(set(local)) != len(local):
            raise ValueError("local block ids repeat")
        peer = await self._peer(endpoint, peer_engine_id, peer_epoch)
        stub = self._stub(endpoint)
        try:
            async with self._slot(stub, lease_id) as queued:
                start = time.perf_counter()
                ample = (
                    lease_expiry_unix_ms is not None
                    and lease_expiry_unix_ms / 1000 - time.time() > SKIP_EXTEND_MARGIN_S
                )
                if queued or not ample:
                    await self._extend(stub, lease_id)
                read_start = time.perf_counter()
                try:
                    num_bytes = await peer.reader.read(lease_id, remote, local)
                except BaseException:
                    self._release_in_background(stub, lease_id)
                    raise
                read_seconds = time.perf_counter() - read_start
                released = await self._release(stub, lease_id)
                seconds = time.perf_counter() - start
        except TransferFailedError:
            self._forget_peer(peer)  # dead or broken: handshake again next time
            raise
        if not released:
            raise LeaseUnavailableError(
                f"lease {lease_id} on engine {peer_engine_id} ended before the pull finished; "
                "its blocks may have been reused"
            )
        return PullResult(num_bytes, seconds, peer.reader.name, read_seconds)

    async def release(self, endpoint: str, lease_id: str) -> bool:
        """Give a lease back without pulling; True if it was still live."""
        return await self._release(self._stub(endpoint), lease_id)

    async def close(self) -> None:
        tasks = [*self._peers.values(), *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in self._peers.values():
            if not task.cancelled() and task.exception() is None:
                task.result().reader.close()
        self._peers.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    # -- handshake ---------------------------------------------------------------------------

    async def _peer(self, endpoint: str, engine_id: str, epoch: int) -> _Peer:
        key = (engine_id, epoch)
        task = self._peers.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._handshake(endpoint, engine_id, epoch), name=f"kv-handshake-{engine_id}"
            )
            self._peers[key] = task
            task.add_done_callback(lambda t: self._on_handshake_done(key, t))
        return await asyncio.shield(task)  # one caller's cancellation must not fail the others

    def _on_handshake_done(self, key: tuple[str, int], task: asyncio.Task[_Peer]) -> None:
        if (task.cancelled() or task.exception() is not None) and self._peers.get(key) is task:
            del self._peers[key]

    async def _handshake(self, endpoint: str, engine_id: str, epoch: int) -> _Peer:
        self.num_handshakes += 1
        request = kvtransfer_pb2.HandshakeRequest(
            engine_id=self.engine_id,
            epoch=self.epoch,
            compat_hash=self.compat_hash,
            transfer_metadata=self._metadata,
        )
        stub = self._stub(endpoint)
        try:
            response = await stub.Handshake(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise IncompatiblePeerError(e.details()) from None
            what = f"handshake with engine {engine_id} at {endpoint}"
            raise TransferFailedError(f"{what}: {e.code().name}: {e.details()}") from None
        if response.compat_hash != self.compat_hash:
            raise IncompatiblePeerError(
                f"engine {self.engine_id} (compat hash {self.compat_hash.hex()}) cannot use KV "
                f"from engine {response.engine_id} (compat hash {response.compat_hash.hex()})"
            )
        if response.block_bytes != self.block_bytes:
            raise IncompatiblePeerError(
                f"engine {response.engine_id} has {response.block_bytes}-byte blocks, engine "
                f"{self.engine_id} has {self.block_bytes}-byte blocks"
            )
        if response.engine_id != engine_id or response.epoch != epoch:
            raise LeaseUnavailableError(
                f"{endpoint} now runs engine {response.engine_id} epoch {response.epoch}, not "
                f"engine {engine_id} epoch {epoch}: the KV handle is stale"
            )
        self._forget_other_epochs(engine_id, epoch)
        return _Peer(engine_id, epoch, self._reader(stub, endpoint, engine_id, response))

    def _reader(self, stub: Any, endpoint: str, engine_id: str, response: Any) -> BlockReader:
        if self.agent is not None:
            try:
                pool = PoolMetadata.decode(response.transfer_metadata)
            except ValueError as e:
                raise TransferFailedError(f"engine {engine_id} sent bad metadata: {e}") from e
            if pool is not None:
                return NixlBlockReader(self.agent, pool, timeout_s=self.transfer_timeout_s)
            if engine_id not in self._grpc_fallbacks_logged:
                self._grpc_fallbacks_logged.add(engine_id)
                logger.warning("engine %s at %s has no NIXL: using gRPC", engine_id, endpoint)
        return GrpcBlockReader(
            stub,
            self._pool_bytes,
            engine_id=self.engine_id,
            chunk_bytes=self.chunk_bytes,
            timeout_s=self.transfer_timeout_s,
        )

    def release_memory(self) -> None:
        """Let go of the pool before its memory is freed (sleep mode): NIXL deregisters it and
        forgets every peer (the next pull from each handshakes again)."""
        for task in list(self._peers.values()):
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().reader.close()
        self._peers.clear()
        if self.agent is not None:
            self.agent.close()

    def restore_memory(self, pool: torch.Tensor) -> None:
        """After ``release_memory``: the pool's memory is back (at another address)."""
        if self.agent is not None:
            self.agent.register(pool)
            self._metadata = self.agent.metadata().encode()
        self._pool_bytes = pool_bytes(pool)

    def _forget_peer(self, peer: _Peer) -> None:
        """Drop a peer's handshake (unless a newer one replaced it) and its reader."""
        key = (peer.engine_id, peer.epoch)
        task = self._peers.get(key)
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return
        if task.result() is peer:
            del self._peers[key]
            peer.reader.close()

    def _forget_other_epochs(self, engine_id: str, epoch: int) -> None:
        """A new epoch means the old process is gone: drop what we kept for it."""
        for (peer_id, peer_epoch), task in list(self._peers.items()):
            if peer_id != engine_id or peer_epoch == epoch or not task.done():
                continue
            if not task.cancelled() and task.exception() is None:
                self._forget_peer(task.result())

    # -- lease control -----------------------------------------------------------------------

    async def hold(
        self,
        endpoint: str,
        lease_id: str,
        waiting: Awaitable[T],
        give_back: Callable[[T], object] | None = None,
    ) -> T:
        """Await ``waiting`` while keeping the lease alive (extended every third of
        ``lease_extend_ms``): for whatever a pull waits on before it starts, such as room to
        land its blocks. If this raises (the lease ended, or it was cancelled), ``waiting`` is
        cancelled; had it already finished, ``give_back`` gets its result."""
        return await self._keep_alive(self._stub(endpoint), lease_id, waiting, give_back)

    async def _keep_alive(
        self,
        stub: Any,
        lease_id: str,
        waiting: Awaitable[T],
        give_back: Callable[[T], object] | None = None,
    ) -> T:
        task = asyncio.ensure_future(waiting)
        try:
            await self._extend(stub, lease_id)
            while not (await asyncio.wait({task}, timeout=self.lease_extend_ms / 3000))[0]:
                await self._extend(stub, lease_id)
        except BaseException:
            task.cancel()  # a no-op once it finished
            finished = task.done() and not task.cancelled() and task.exception() is None
            if give_back is not None and finished:
                give_back(task.result())
            raise
        return task.result()

    @contextlib.asynccontextmanager
    async def _slot(self, stub: Any, lease_id: str) -> AsyncIterator[bool]:
        """Hold one of the pull slots; while waiting for it, keep the lease alive. Yields
        whether it waited."""
        queued = self._slots.locked()
        if queued:
            await self._keep_alive(
                stub, lease_id, self._slots.acquire(), lambda _: self._slots.release()
            )
        else:
            await self._slots.acquire()
        try:
            yield queued
        finally:
            self._slots.release()

    async def _extend(self, stub: Any, lease_id: str) -> None:
        request = kvtransfer_pb2.ExtendLeaseRequest(
            lease_id=lease_id, extend_ms=self.lease_extend_ms
        )
        try:
            await stub.ExtendLease(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(f"extending lease {lease_id}", e) from None

    async def _release(self, stub: Any, lease_id: str) -> bool:
        request = kvtransfer_pb2.ReleaseLeaseRequest(lease_id=lease_id)
        try:
            response = await stub.ReleaseLease(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(f"releasing lease {lease_id}", e) from None
        return bool(response.released)

    def _release_in_background(self, stub: Any, lease_id: str) -> None:
        """After a failed move: free the source's blocks now rather than at expiry."""

        async def release() -> None:
            with contextlib.suppress(KVTransferError):
                await self._release(stub, lease_id)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _stub(self, endpoint: str) -> Any:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = grpc.aio.insecure_channel(
                endpoint,
                options=[("grpc.max_receive_message_length", MAX_CHUNK_BYTES + (1 << 20))],
                interceptors=self.interceptors or None,
            )
            self._channels[endpoint] = channel
        return kvtransfer_pb2_grpc.KVTransferServiceStub(channel)  # type: ignore[no-untyped-call]
