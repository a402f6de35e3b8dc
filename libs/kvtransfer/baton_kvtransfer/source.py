"""The source (prefill) side: ``KVTransferService`` over one KV pool and its ``LeaseTable``.

``Handshake`` checks the compatibility hash (FAILED_PRECONDITION on a mismatch) and returns
this engine's identity, ``block_bytes`` and transfer metadata (NIXL pool metadata, or empty for
a gRPC-only source). ``PullBlocks`` streams leased blocks; ``ExtendLease`` and
``ReleaseLease`` manage the lease around a pull. An unknown, expired or released lease (or
blocks it does not cover) is NOT_FOUND. A source created with backend "nixl" serves both
transports: a gRPC sink ignores the NIXL metadata and uses ``PullBlocks``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeAlias

import grpc
import torch

from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from baton_kvtransfer.blocks import block_bytes, check_block_ids, check_pool, pool_bytes
from baton_kvtransfer.errors import LeaseUnavailableError
from baton_kvtransfer.leases import LeaseTable
from baton_kvtransfer.nixl_agent import NixlAgent, agent_name, resolve_backend
from baton_kvtransfer.streaming import clamp_chunk_bytes, iter_chunks

logger = logging.getLogger(__name__)

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
_PROGRESS_BUSY_S = 0.001  # while some lease is live, a peer may be reading
_PROGRESS_IDLE_S = 0.05


async def _abort(context: Context, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")


class KVTransferServicer(kvtransfer_pb2_grpc.KVTransferServiceServicer):
    """Serves one pool and one lease table; every method runs on the asyncio loop."""

    def __init__(
        self,
        pool: torch.Tensor,
        *,
        engine_id: str,
        epoch: int,
        compat_hash: bytes,
        leases: LeaseTable,
        transfer_metadata: bytes = b"",
        on_handshake: Callable[[], None] | None = None,
    ) -> None:
        check_pool(pool)
        self.engine_id = engine_id
        self.epoch = epoch
        self.compat_hash = compat_hash
        self.leases = leases
        self.transfer_metadata = transfer_metadata
        self.on_handshake = on_handshake
        self.num_blocks = pool.shape[0]
        self.block_bytes = block_bytes(pool)
        self._pool_bytes = pool_bytes(pool)
        self.num_handshakes = 0

    async def Handshake(
        self, request: kvtransfer_pb2.HandshakeRequest, context: Context
    ) -> kvtransfer_pb2.HandshakeResponse:
        self.num_handshakes += 1
        if request.compat_hash != self.compat_hash:
            await _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"engine {request.engine_id} (compat hash {request.compat_hash.hex()}) cannot "
                f"use KV from engine {self.engine_id} (compat hash {self.compat_hash.hex()}): "
                "the model, dtype, block size or KV layout differ",
            )
        if self.on_handshake is not None:
            self.on_handshake()
        return kvtransfer_pb2.HandshakeResponse(
            engine_id=self.engine_id,
            epoch=self.epoch,
            compat_hash=self.compat_hash,
            transfer_metadata=self.transfer_metadata,
            block_bytes=self.block_bytes,
        )

    async def PullBlocks(
        self, request: kvtransfer_pb2.PullBlocksRequest, context: Context
    ) -> AsyncIterator[kvtransfer_pb2.PullBlocksResponse]:
        """Stream the blocks in request order. A lease that ends mid-stream ends the stream
        (NOT_FOUND): the sink must not use what it got."""
        block_ids = list(request.block_ids)
        try:
            check_block_ids(block_ids, self.num_blocks, "requested")
            self.leases.check(request.lease_id, block_ids)
        except ValueError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except LeaseUnavailableError as e:
            await _abort(context, grpc.StatusCode.NOT_FOUND, str(e))
        chunk_bytes = clamp_chunk_bytes(request.chunk_bytes)
        for offset, data in iter_chunks(self._pool_bytes, block_ids, chunk_bytes):
            # No await since the copy: the lease held while it was made.
            if self.leases.get(request.lease_id) is None:
                await _abort(
                    context, grpc.StatusCode.NOT_FOUND, f"lease {request.lease_id} ended mid-pull"
                )
            yield kvtransfer_pb2.PullBlocksResponse(offset=offset, data=data)

    async def ExtendLease(
        self, request: kvtransfer_pb2.ExtendLeaseRequest, context: Context
    ) -> kvtransfer_pb2.ExtendLeaseResponse:
        try:
            lease = self.leases.extend(request.lease_id, max(0, request.extend_ms))
        except LeaseUnavailableError as e:
            await _abort(context, grpc.StatusCode.NOT_FOUND, str(e))
        return kvtransfer_pb2.ExtendLeaseResponse(lease_expiry_unix_ms=lease.expiry_unix_ms)

    async def ReleaseLease(
        self, request: kvtransfer_pb2.ReleaseLeaseRequest, context: Context
    ) -> kvtransfer_pb2.ReleaseLeaseResponse:
        return kvtransfer_pb2.ReleaseLeaseResponse(released=self.leases.release(request.lease_id))


class KVTransferSource:
    """The source side of one worker: its pool (registered with NIXL for backend "nixl"),
    the gRPC service, and the NIXL progress pump that runs once a peer has handshaken."""

    def __init__(
        self,
        pool: torch.Tensor,
        *,
        engine_id: str,
        epoch: int,
        compat_hash: bytes,
        leases: LeaseTable,
        backend: str = "grpc",
    ) -> None:
        check_pool(pool)
        self.backend = resolve_backend(backend)
        self.leases = leases
        self.agent: NixlAgent | None = None
        if self.backend == "nixl":
            self.agent = NixlAgent(agent_name(engine_id, "source"), pool)
        self._progress_task: asyncio.Task[None] | None = None
        self.servicer = KVTransferServicer(
            pool,
            engine_id=engine_id,
            epoch=epoch,
            compat_hash=compat_hash,
            leases=leases,
            transfer_metadata=self.metadata(),
            on_handshake=self._start_progress if self.agent is not None else None,
        )

    def metadata(self) -> bytes:
        """Transfer metadata for handshakes and the worker directory (empty: gRPC only)."""
        return self.agent.metadata().encode() if self.agent is not None else b""

    def add_to_server(self, server: grpc.aio.Server) -> None:
        kvtransfer_pb2_grpc.add_KVTransferServiceServicer_to_server(self.servicer, server)  # type: ignore[no-untyped-call]

    def release_memory(self) -> None:
        """Let go of the pool before its memory is freed (sleep mode; no lease is live): NIXL
        deregisters it."""
        if self._progress_task is not None:
            self._progress_task.cancel()
            self._progress_task = None
        if self.agent is not None:
            self.agent.close()

    def restore_memory(self, pool: torch.Tensor, epoch: int) -> None:
        """After ``release_memory``: the pool's memory is back at another address, served
        under a new ``epoch`` (peers that kept the old registration handshake again)."""
        if self.agent is not None:
            self.agent.register(pool)
        servicer = self.servicer
        servicer.epoch = epoch
        servicer.transfer_metadata = self.metadata()
        servicer._pool_bytes = pool_bytes(pool)

    def close(self) -> None:
        if self._progress_task is not None:
            self._progress_task.cancel()
            self._progress_task = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    def _start_progress(self) -> None:
        if self._progress_task is None:
            self._progress_task = asyncio.get_running_loop().create_task(
                self._progress(), name="kv-source-nixl-progress"
            )

    async def _progress(self) -> None:
        while self.agent is not None:
            try:
                self.agent.progress()
            except Exception:  # a peer's failure must not stop serving the others
                logger.exception("NIXL progress failed")
            busy = self.leases.num_active > 0
            await asyncio.sleep(_PROGRESS_BUSY_S if busy else _PROGRESS_IDLE_S)
