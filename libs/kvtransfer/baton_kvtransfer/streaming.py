"""The gRPC transport: ``PullBlocks`` streams the requested blocks concatenated in request
order, cut into chunks of ``chunk_bytes`` (the last may be shorter). The source reads the
chunks from its pool (``iter_chunks``); the sink's ``GrpcBlockReader`` writes them into its
pool's rows (``ChunkWriter``).
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import torch

from baton.v1 import kvtransfer_pb2
from baton_kvtransfer.blocks import merge_runs
from baton_kvtransfer.errors import TransferFailedError, error_from_rpc

DEFAULT_CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 16 << 20


def clamp_chunk_bytes(chunk_bytes: int) -> int:
    """A requested chunk size (0: the default) within what both sides accept."""
    if chunk_bytes <= 0:
        return DEFAULT_CHUNK_BYTES
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, chunk_bytes))


def iter_chunks(
    pool_bytes: torch.Tensor, block_ids: Sequence[int], chunk_bytes: int
) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, data)`` over the blocks of ``pool_bytes`` (``[num_blocks,
    block_bytes]`` uint8) named by ``block_ids``; each chunk is copied when it is reached."""
    bb = pool_bytes.shape[1]
    flat = pool_bytes.view(-1)
    offset = 0
    pieces: list[memoryview] = []
    num_pending = 0
    for run in merge_runs(block_ids, block_ids):  # consecutive ids: one contiguous range
        start = run.src_block_id * bb
        end = start + run.num_blocks * bb
        while start < end:
            take = min(end - start, chunk_bytes - num_pending)
            # .cpu() is a no-op for a DRAM pool, so this is a view until the join below
            pieces.append(flat[start : start + take].cpu().numpy().data)
            num_pending += take
            start += take
            if num_pending == chunk_bytes:
                yield offset, b"".join(pieces)
                offset += num_pending
                pieces, num_pending = [], 0
    if num_pending:
        yield offset, b"".join(pieces)


class ChunkWriter:
    """Writes a stream of chunks into the pool rows ``block_ids`` (in stream order).

    Runs on the worker's event loop, so a DRAM pool is written through numpy: a torch copy
    there would start an OpenMP thread pool beside the engine thread's and slow every later
    engine step (see ``baton_decode.engine_loop.EngineThread``)."""

    def __init__(self, pool_bytes: torch.Tensor, block_ids: Sequence[int]) -> None:
        bb = pool_bytes.shape[1]
        self._flat = pool_bytes.view(-1)
        self._flat_np = self._flat.numpy() if self._flat.device.type == "cpu" else None
        self._run_offsets: list[int] = []  # stream offset where each run of rows starts
        self._run_starts: list[int] = []  # byte offset of the run in the pool
        self._run_lengths: list[int] = []
        offset = 0
        for run in merge_runs(block_ids, block_ids):
            self._run_offsets.append(offset)
            self._run_starts.append(run.dst_block_id * bb)
            self._run_lengths.append(run.num_blocks * bb)
            offset += run.num_blocks * bb
        self.num_bytes_expected = offset
        self.num_bytes = 0

    def write(self, offset: int, data: bytes) -> None:
        if offset != self.num_bytes:
            raise TransferFailedError(f"chunk at byte {offset}, expected {self.num_bytes}")
        if offset + len(data) > self.num_bytes_expected:
            raise TransferFailedError(
                f"the stream is longer than the {self.num_bytes_expected} bytes asked for"
            )
        if not data:
            return
        src_np = np.frombuffer(data, dtype=np.uint8)
        with warnings.catch_warnings():  # read-only source buffer: it is only copied from
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(src_np)
        i = bisect.bisect_right(self._run_offsets, offset) - 1
        pos = 0
        while pos < len(data):
            in_run = offset + pos - self._run_offsets[i]
            n = min(self._run_lengths[i] - in_run, len(data) - pos)
            dst = self._run_starts[i] + in_run
            if self._flat_np is not None:
                self._flat_np[dst : dst + n] = src_np[pos : pos + n]
            else:
                self._flat[dst : dst + n].copy_(src[pos : pos + n])
            pos += n
            i += 1
        self.num_bytes += len(data)

    def finish(self) -> None:
        if self.num_bytes != self.num_bytes_expected:
            raise TransferFailedError(
                f"the stream ended after {self.num_bytes} of {self.num_bytes_expected} bytes"
            )


class GrpcBlockReader:
    """Reads a peer's blocks through its ``PullBlocks`` stream into the local pool."""

    name = "grpc"

    def __init__(
        self,
        stub: Any,  # KVTransferServiceStub of the peer
        pool_bytes: torch.Tensor,
        *,
        engine_id: str,
        chunk_bytes: int,
        timeout_s: float,
    ) -> None:
        self.stub = stub
        self.pool_bytes = pool_bytes
        self.engine_id = engine_id
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s

    async def read(self, lease_id: str, remote: list[int], local: list[int]) -> int:
        writer = ChunkWriter(self.pool_bytes, local)
        request = kvtransfer_pb2.PullBlocksRequest(
            lease_id=lease_id,
            block_ids=remote,
            requester_engine_id=self.engine_id,
            chunk_bytes=self.chunk_bytes,
        )
        call = self.stub.PullBlocks(request, timeout=self.timeout_s)
        try:
            async for chunk in call:
                writer.write(chunk.offset, chunk.data)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(f"pulling blocks under lease {lease_id}", e) from None
        finally:
            call.cancel()  # a no-op once the stream has ended
        writer.finish()
        return writer.num_bytes

    def close(self) -> None:
        pass
