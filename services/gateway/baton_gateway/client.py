"""Async gRPC client of the decode workers: connect, route by load, stream, map errors.

Routing (for now): the worker with the least load, where a worker's load is the larger of the
Generate calls this gateway has open on it and the running + waiting requests it last reported
through ``GetLoad`` (polled in the background, so other gateways' traffic counts too); ties go
round robin. Prefix-aware routing comes with the kvstore.

gRPC status -> HTTP status, for the client: INVALID_ARGUMENT / OUT_OF_RANGE 400,
RESOURCE_EXHAUSTED / UNAVAILABLE 503 (the OpenAI SDK retries 503), DEADLINE_EXCEEDED 504,
UNIMPLEMENTED 501, anything else 500.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from http import HTTPStatus

import grpc

from baton.v1 import engine_pb2, engine_pb2_grpc
from baton_gateway import codec
from baton_gateway.codec import GenerateChunk, ModelInfo, WorkerLoad
from baton_gateway.errors import GatewayError

logger = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
    grpc.StatusCode.UNIMPLEMENTED: HTTPStatus.NOT_IMPLEMENTED,
}
# A GetLoad answer older than this no longer counts (the worker may be gone).
_LOAD_TTL_S = 5.0


def rpc_error(error: grpc.aio.AioRpcError, addr: str) -> GatewayError:
    """The client-facing error for a failed call to the worker at ``addr``."""
    code = error.code()
    status = _HTTP_STATUS.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
    details = error.details() or code.name
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        message = f"the server is at capacity, retry later ({details})"
    elif status == HTTPStatus.BAD_REQUEST:
        message = details  # the engine's own message, meant for the client
    else:
        message = f"decode worker {addr}: {code.name}: {details}"
    return GatewayError(status, message)


@dataclass(eq=False)
class DecodeWorker:
    """One decode worker as this gateway sees it."""

    addr: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.DecodeServiceStub
    info: ModelInfo | None = None
    num_inflight: int = 0  # Generate calls this gateway has open on it
    load: WorkerLoad | None = None  # last GetLoad answer
    load_time: float = -1.0  # loop time of that answer
    healthy: bool = False  # the last GetModelInfo / GetLoad call succeeded

    def score(self, now: float) -> int:
        reported = 0
        if self.load is not None and now - self.load_time < _LOAD_TTL_S:
            reported = self.load.num_running + self.load.num_waiting
        return max(self.num_inflight, reported)


class DecodePool:
    """The decode workers behind this gateway. Use from one asyncio loop.

    ``connect`` must succeed before ``generate``; ``close`` cancels the load poller and closes
    the channels (in-flight calls end with CANCELLED).
    """

    def __init__(self, addrs: Sequence[str], poll_interval_s: float = 0.5) -> None:
        if not addrs:
            raise ValueError("at least one decode worker address is needed")
        self.workers = [
            DecodeWorker(addr, ch, engine_pb2_grpc.DecodeServiceStub(ch))  # type: ignore[no-untyped-call]
            for addr, ch in ((a, grpc.aio.insecure_channel(a)) for a in addrs)
        ]
        self._poll_interval_s = poll_interval_s
        self._poller: asyncio.Task[None] | None = None
        self._round_robin = itertools.count()

    async def connect(self, timeout_s: float = 60.0) -> ModelInfo:
        """Wait until every worker answers ``GetModelInfo`` (retrying until ``timeout_s``), start
        polling their load, and return the first worker's model info.

        Raises GatewayError (503) naming the workers that never answered.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = list(self.workers)
        last_error: dict[str, str] = {}
        while pending:
            for worker in list(pending):
                try:
                    pb = await worker.stub.GetModelInfo(
                        codec.get_model_info_request(), timeout=max(0.1, deadline - loop.time())
                    )
                except grpc.aio.AioRpcError as e:
                    last_error[worker.addr] = f"{e.code().name}: {e.details()}"
                    continue
                worker.info, worker.healthy = codec.model_info(pb), True
                pending.remove(worker)
            if pending and loop.time() >= deadline:
                why = "; ".join(f"{w.addr} ({last_error.get(w.addr, '?')})" for w in pending)
                raise GatewayError(
                    HTTPStatus.SERVICE_UNAVAILABLE, f"decode workers did not answer: {why}"
                )
            if pending:
                await asyncio.sleep(0.2)
        infos = {w.info.max_model_len for w in self.workers if w.info is not None}
        if len(infos) > 1:
            logger.warning("decode workers disagree on max_model_len: %s", sorted(infos))
        self._poller = asyncio.create_task(self._poll_loads())
        first = self.workers[0].info
        assert first is not None
        return first

    async def _poll_loads(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            results = await asyncio.gather(
                *(w.stub.GetLoad(codec.get_load_request(), timeout=1.0) for w in self.workers),
                return_exceptions=True,
            )
            now = loop.time()
            for worker, result in zip(self.workers, results, strict=True):
                if isinstance(result, engine_pb2.GetLoadResponse):
                    worker.load, worker.load_time, worker.healthy = (
                        codec.worker_load(result),
                        now,
                        True,
                    )
                else:
                    if worker.healthy:
                        logger.warning("decode worker %s did not answer GetLoad: %s",
                                       worker.addr, result)  # fmt: skip
                    worker.healthy = False
            await asyncio.sleep(self._poll_interval_s)

    @property
    def healthy(self) -> bool:
        return any(w.healthy for w in self.workers)

    def pick(self) -> DecodeWorker:
        """The least-loaded worker, preferring healthy ones; ties round robin."""
        now = asyncio.get_running_loop().time()
        candidates = [w for w in self.workers if w.healthy] or self.workers
        start = next(self._round_robin) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda w: w.score(now))

    async def generate(
        self, request: engine_pb2.GenerateRequest
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Run ``request`` on the least-loaded worker and yield its chunks as they arrive.

        Closing the generator (or cancelling the task iterating it) cancels the gRPC call, which
        aborts the request on the worker. Raises GatewayError for a failed call.
        """
        worker = self.pick()
        worker.num_inflight += 1
        call = worker.stub.Generate(request)
        try:
            async for pb in call:
                yield codec.generate_chunk(pb)
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e, worker.addr) from e
        finally:
            worker.num_inflight -= 1
            call.cancel()  # a no-op when the call has already ended

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.workers), return_exceptions=True)
