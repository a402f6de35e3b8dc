"""Async gRPC client of the engine workers: find them, route each sequence, stream, recover.

Workers come from the command line (``--decode-addr``, ``--prefill-addr``) and, with a kvstore,
from its directory (polled; workers whose registration expired are dropped). Every worker's
``GetLoad`` is polled in the background; one that stops answering is marked unhealthy and gets no
new requests until it answers again.

Routing one sequence (``WorkerPool.generate``), as DESIGN.md §2 describes:

1. The prompt's chained block hashes are looked up in the kvstore's prefix index (when there is
   one) to learn how many leading blocks each worker caches.
2. The decode worker is the healthy one with the lowest cost: prompt tokens it would have to
   prefill (uncached) plus ``load_weight`` per request it is running, queueing or being sent.
3. If the tokens not cached there exceed ``remote_prefill_threshold`` and a healthy prefill worker
   has room, the prompt is prefilled remotely (the prefill worker with the lowest cost, same
   formula) and its first token is yielded at once, before the decode worker pulls the KV;
   otherwise the decode worker prefills locally. With ``max_remote_prefill_wait_s`` set, a
   prompt is also prefilled locally when the prefill worker's queue would keep it waiting
   longer than that and the decode worker has less prefill queued (conditional
   disaggregation: a saturated prefill pool does not stall every new request while the decode
   GPU has room). Each decision is counted by reason.

Failures: a prefill worker that fails (unavailable, at capacity) is marked and another one is
tried, then local prefill. A decode worker that fails before it streamed any token is replaced by
another healthy one (the request carries the same first token and KV handle, or prefills again
locally when none came remotely); after tokens were streamed the call ends with an error. A
sequence that ends early (client gone, error) aborts its remote prefill, so the prefill worker
frees the KV at once instead of at lease expiry.

Every sequence routed to a decode worker goes over the one ``GenerateStream`` call this gateway
keeps open to it (``GenerateStreams``): the worker sends one message per engine step for all of
them. Each sequence still fails, retries and cancels on its own, as with a ``Generate`` call.

gRPC status -> HTTP status, for the client: INVALID_ARGUMENT / OUT_OF_RANGE 400,
RESOURCE_EXHAUSTED / UNAVAILABLE 503 (the OpenAI SDK retries 503), DEADLINE_EXCEEDED 504,
UNIMPLEMENTED 501, anything else 500.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import grpc

from baton import tracing
from baton.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from baton_engine.kv_cache.hashing import hash_request_tokens, prefix_root
from baton_gateway import codec
from baton_gateway.codec import GenerateChunk, ModelInfo, WorkerLoad
from baton_gateway.errors import GatewayError

logger = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
    grpc.StatusCode.UNIMPLEMENTED: HTTPStatus.NOT_IMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION: HTTPStatus.SERVICE_UNAVAILABLE,  # (asleep)
}
# Failures another worker may not repeat: the sequence is tried elsewhere.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,  # the worker went away mid-call
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}
# A call that failed so is taken as the worker being down (not as its answer).
_DOWN_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}
# A GetLoad answer older than this no longer counts (the worker may be gone).
_LOAD_TTL_S = 5.0
DECODE, PREFILL = "decode", "prefill"


def rpc_error(error: grpc.aio.AioRpcError, addr: str) -> GatewayError:
    """The client-facing error for a failed call to the worker at ``addr``."""
    code = error.code()
    status = _HTTP_STATUS.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
    details = error.details() or code.name
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        message = f"the server is at capacity, retry later ({details})"
    elif status in (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND):
        message = details  # the engine's own message, meant for the client
    else:
        message = f"worker {addr}: {code.name}: {details}"
    return GatewayError(status, message)


class PrefillBacklog:
    """Prompt tokens this gateway has sent a worker to prefill whose first token has not come
    back yet, and the worker's prefill speed learnt from them: tokens completed per second
    while tokens were pending (a decayed average over the last completions)."""

    DECAY = 0.9  # per completion: about the last ten count

    def __init__(self) -> None:
        self.pending = 0
        self._changed = 0.0  # loop time of the last change of ``pending``
        self._busy_s = 0.0  # seconds with tokens pending since the last completion
        self._avg_busy_s = 0.0
        self._avg_tokens = 0.0

    def _accrue(self, now: float) -> None:
        if self.pending > 0:
            self._busy_s += now - self._changed
        self._changed = now

    def add(self, num_tokens: int, now: float) -> None:
        self._accrue(now)
        self.pending += num_tokens

    def remove(self, num_tokens: int, now: float, completed: bool) -> None:
        """``num_tokens`` are no longer pending: prefilled (``completed``) or given up."""
        self._accrue(now)
        self.pending -= num_tokens
        if completed:
            self._avg_busy_s = self._avg_busy_s * self.DECAY + self._busy_s
            self._avg_tokens = self._avg_tokens * self.DECAY + num_tokens
            self._busy_s = 0.0

    def tokens_per_s(self) -> float | None:
        """The learnt prefill speed; None before a first completion."""
        if self._avg_tokens <= 0 or self._avg_busy_s <= 0:
            return None
        return self._avg_tokens / self._avg_busy_s

    def wait_s(self) -> float:
        """How long a prompt sent now would wait for the tokens ahead of it (0 while the speed
        is unknown)."""
        speed = self.tokens_per_s()
        return self.pending / speed if speed else 0.0


@dataclass(eq=False)
class Worker:
    """One engine worker as this gateway sees it."""

    addr: str
    role: str  # "decode" | "prefill"
    channel: grpc.aio.Channel
    stub: Any  # DecodeServiceStub | PrefillServiceStub (generated, untyped)
    worker_id: str = ""  # the kvstore's id, when it came from there
    static: bool = True  # from the command line: never dropped
    info: ModelInfo | None = None
    num_inflight: int = 0  # calls this gateway has open on it
    load: WorkerLoad | None = None  # last GetLoad answer
    load_time: float = -1.0  # loop time of that answer
    healthy: bool = False  # the last GetModelInfo / GetLoad call succeeded
    streams: GenerateStreams | None = None  # decode workers: the shared GenerateStream call
    backlog: PrefillBacklog = field(default_factory=PrefillBacklog)  # prompts sent to prefill

    def num_requests(self, now: float) -> int:
        reported = 0
        if self.load is not None and now - self.load_time < _LOAD_TTL_S:
            reported = self.load.num_running + self.load.num_waiting
        return max(self.num_inflight, reported)

    def has_room(self, now: float) -> bool:
        """Not saturated: fewer requests than its batch holds (prefill workers)."""
        if self.load is None or self.load.max_num_seqs <= 0:
            return True
        return self.num_requests(now) < self.load.max_num_seqs


def _new_worker(addr: str, role: str, *, worker_id: str = "", static: bool = True) -> Worker:
    channel = grpc.aio.insecure_channel(addr)
    stub_type = (
        engine_pb2_grpc.DecodeServiceStub if role == DECODE else engine_pb2_grpc.PrefillServiceStub
    )
    stub = stub_type(channel)
    worker = Worker(addr, role, channel, stub, worker_id=worker_id, static=static)
    if role == DECODE:
        worker.streams = GenerateStreams(stub)
    return worker


_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def _call_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class StreamedCall:
    """One sequence's part of a ``GenerateStream`` call, used like the call of a ``Generate``:
    iterate it for the worker's ``GenerateResponse`` messages (a failure raises
    ``grpc.aio.AioRpcError`` with the request's status), ``cancel()`` it to abort the request."""

    def __init__(self, owner: _StreamCall, req_id: str) -> None:
        self._owner = owner
        self.req_id = req_id
        self.queue: asyncio.Queue[engine_pb2.GenerateStreamItem | grpc.aio.AioRpcError] = (
            asyncio.Queue()
        )
        self._ended = False

    async def __aiter__(self) -> AsyncGenerator[engine_pb2.GenerateResponse, None]:
        while not self._ended:
            item = await self.queue.get()
            if isinstance(item, grpc.aio.AioRpcError):
                self._end()
                raise item
            if item.error_code:
                self._end()
                code = _STATUS_BY_VALUE.get(item.error_code, grpc.StatusCode.UNKNOWN)
                raise _call_error(code, item.error_message)
            if item.response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                self._end()
            yield item.response

    def _end(self) -> None:
        self._ended = True
        self._owner.requests.pop(self.req_id, None)

    def cancel(self) -> None:
        """Abort the request on the worker unless it has ended (a no-op then)."""
        if not self._ended:
            self._end()
            self._owner.send(engine_pb2.GenerateStreamRequest(cancel_req_id=self.req_id))


class _StreamCall:
    """One open ``GenerateStream`` call: what to send on it, and whose items come back."""

    def __init__(self, stub: Any) -> None:
        self.requests: dict[str, StreamedCall] = {}
        # None: the call is over and the request stream ends (else gRPC's task that reads it
        # would wait on the outbox for good, and be destroyed pending when this is dropped)
        self._outbox: asyncio.Queue[engine_pb2.GenerateStreamRequest | None] = asyncio.Queue()
        self.messages = self._messages()
        self.call = stub.GenerateStream(self.messages)
        self.reader = asyncio.ensure_future(self._read())

    async def _messages(self) -> AsyncGenerator[engine_pb2.GenerateStreamRequest, None]:
        while (message := await self._outbox.get()) is not None:
            yield message

    def send(self, message: engine_pb2.GenerateStreamRequest) -> None:
        self._outbox.put_nowait(message)

    async def _read(self) -> None:
        error = _call_error(grpc.StatusCode.UNAVAILABLE, "the worker ended the stream")
        try:
            async for response in self.call:
                for item in response.items:
                    request = self.requests.get(item.req_id)
                    if request is not None:
                        request.queue.put_nowait(item)
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = _call_error(grpc.StatusCode.CANCELLED, "the gateway closed the stream")
            raise
        finally:
            self._outbox.put_nowait(None)
            for request in list(self.requests.values()):
                request.queue.put_nowait(error)
            self.requests.clear()

    @property
    def open(self) -> bool:
        return not self.reader.done()

    async def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


class GenerateStreams:
    """The decode requests this gateway routes to one worker, all over one ``GenerateStream``
    call (opened on first use and again after it fails): the worker sends one message per engine
    step for all of them, not one per sequence and step, which on a 2-core CPU is ~0.8 ms less
    CPU per step at 16 streams between the two processes (``benchmarks/RESULTS.md``)."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self._current: _StreamCall | None = None

    def generate(self, request: engine_pb2.GenerateRequest, metadata: Any) -> StreamedCall:
        if self._current is None or not self._current.open:
            self._current = _StreamCall(self._stub)
        call = self._current
        streamed = StreamedCall(call, request.req_id)
        call.requests[request.req_id] = streamed
        call.send(engine_pb2.GenerateStreamRequest(generate=request, trace_context=dict(metadata)))
        return streamed

    async def close(self) -> None:
        if self._current is not None:
            await self._current.close()


@dataclass(frozen=True)
class RouteDecision:
    decode: Worker
    prefill: Worker | None
    reason: str  # for baton:disagg_decisions_total{decision}
    num_uncached_tokens: int


class WorkerPool:
    """The engine workers behind this gateway. Use from one asyncio loop.

    ``connect`` must succeed before ``generate``; ``close`` cancels the background poller and
    closes the channels (in-flight calls end with CANCELLED). ``kvstore`` is a
    ``baton_kvstore.client.KVStoreClient`` or None; ``on_decision(reason)`` counts routing
    decisions.
    """

    def __init__(
        self,
        decode_addrs: Sequence[str] = (),
        prefill_addrs: Sequence[str] = (),
        *,
        kvstore: Any = None,
        remote_prefill_threshold: int = 256,
        load_weight: int = 64,
        poll_interval_s: float = 0.5,
        on_decision: Callable[[str], None] | None = None,
        max_remote_prefill_wait_s: float | None = None,
    ) -> None:
        if not decode_addrs and kvstore is None:
            raise ValueError("at least one decode worker address (or a kvstore) is needed")
        self.workers: list[Worker] = [_new_worker(a, DECODE) for a in decode_addrs]
        self.workers += [_new_worker(a, PREFILL) for a in prefill_addrs]
        self.kvstore = kvstore
        self.remote_prefill_threshold = remote_prefill_threshold
        self.load_weight = load_weight
        self.max_remote_prefill_wait_s = max_remote_prefill_wait_s
        self._poll_interval_s = poll_interval_s
        self._on_decision = on_decision or (lambda reason: None)
        self._poller: asyncio.Task[None] | None = None
        self._round_robin = itertools.count()
        self._background: set[asyncio.Task[Any]] = set()
        self.block_size = 16
        # LoRA adapters loaded (name -> folder) and unloaded at run time: a worker that comes
        # (back) up gets the same, before it is routed to (``_restore_adapters``)
        self._loaded_adapters: dict[str, str] = {}
        self._unloaded_adapters: set[str] = set()

    # --- membership ----------------------------------------------------------------------------

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Have every worker serve the LoRA adapter (runtime LoRA updating): those up now, and
        each one that comes (back) up later (a restarted worker, one found in the kvstore).
        If one refuses, those that took it unload it again, and its error is raised
        (GatewayError); one that does not answer is marked down (it gets the adapter when it
        is up again)."""
        self._loaded_adapters[lora_name] = lora_path  # (first: a worker coming up meanwhile)
        was_unloaded = lora_name in self._unloaded_adapters
        self._unloaded_adapters.discard(lora_name)
        request = engine_pb2.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        workers = [w for w in self.workers if w.healthy]
        results = await asyncio.gather(
            *(w.stub.LoadLoRAAdapter(request) for w in workers), return_exceptions=True
        )
        failed = [
            (w, r)
            for w, r in zip(workers, results, strict=True)
            if isinstance(r, Exception) and not self._went_down(w, r)
        ]
        if not failed:
            return
        del self._loaded_adapters[lora_name]
        if was_unloaded:
            self._unloaded_adapters.add(lora_name)
        took = [w for w, r in zip(workers, results, strict=True) if not isinstance(r, Exception)]
        undo = engine_pb2.UnloadLoRAAdapterRequest(lora_name=lora_name)
        await asyncio.gather(
            *(w.stub.UnloadLoRAAdapter(undo) for w in took), return_exceptions=True
        )
        worker, error = failed[0]
        if isinstance(error, grpc.aio.AioRpcError):
            raise rpc_error(error, worker.addr) from error
        raise error

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Have every worker stop serving the LoRA adapter (one down now: when it is up
        again); raises the first refusal (GatewayError: NOT_FOUND where a worker does not
        serve it)."""
        self._loaded_adapters.pop(lora_name, None)
        self._unloaded_adapters.add(lora_name)
        request = engine_pb2.UnloadLoRAAdapterRequest(lora_name=lora_name)
        workers = [w for w in self.workers if w.healthy]
        results = await asyncio.gather(
            *(w.stub.UnloadLoRAAdapter(request) for w in workers), return_exceptions=True
        )
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError) and not self._went_down(worker, result):
                raise rpc_error(result, worker.addr) from result
            if isinstance(result, Exception) and not isinstance(result, grpc.aio.AioRpcError):
                raise result

    async def sleep(self, level: int, mode: str) -> None:
        """Put every worker up to sleep (sleep mode), its requests aborted, finished first or
        kept (``mode``); the first refusal (sleep mode off, a bad level or mode) raises, the
        workers that slept are woken again (all or none sleep)."""
        request = engine_pb2.SleepRequest(level=level, mode=mode)
        await self._on_every_worker("Sleep", request, ("WakeUp", engine_pb2.WakeUpRequest()))

    async def pause(self, mode: str, clear_cache: bool) -> None:
        """Pause every worker up (vLLM's pause_generation): new requests wait until
        ``resume``, those in flight are aborted, finished first or kept (``mode``); the
        prefix cache is forgotten after (``clear_cache``). All or none pause."""
        request = engine_pb2.PauseRequest(mode=mode, clear_cache=clear_cache)
        await self._on_every_worker("Pause", request, ("Resume", engine_pb2.ResumeRequest()))

    async def profile(self, start: bool) -> None:
        """Start (or stop) every worker's profiler (``--profiler-config``); a refusal (profiling
        off, started twice) raises, the workers that started stop again."""
        if start:
            request, undo = engine_pb2.StartProfileRequest(), engine_pb2.StopProfileRequest()
            await self._on_every_worker("StartProfile", request, ("StopProfile", undo))
        else:
            await self._on_every_worker("StopProfile", engine_pb2.StopProfileRequest())

    async def resume(self) -> None:
        await self._on_every_worker("Resume", engine_pb2.ResumeRequest())

    async def is_paused(self) -> bool:
        """Whether any worker up is paused."""
        results = await self._on_every_worker("IsPaused", engine_pb2.IsPausedRequest())
        return any(r.is_paused for r in results)

    async def wake_up(self, tags: list[str]) -> None:
        """Wake ``tags`` (none: every part) on every worker up."""
        await self._on_every_worker("WakeUp", engine_pb2.WakeUpRequest(tags=tags))

    async def reload_weights(self) -> int:
        """Have every worker up read its weights again (vLLM's ``collective_rpc
        ("reload_weights")``); the number of ranks that did, summed over workers."""
        results = await self._on_every_worker("ReloadWeights", engine_pb2.ReloadWeightsRequest())
        return sum(r.num_ranks for r in results)

    async def is_sleeping(self) -> bool:
        """Whether any worker up is asleep (or partly)."""
        request = engine_pb2.IsSleepingRequest()
        workers = [w for w in self.workers if w.healthy]
        results = await asyncio.gather(
            *(w.stub.IsSleeping(request, timeout=30.0) for w in workers), return_exceptions=True
        )
        return any(not isinstance(r, BaseException) and r.is_sleeping for r in results)

    async def _on_every_worker(
        self, method: str, request: Any, undo: tuple[str, Any] | None = None
    ) -> list[Any]:
        """Call ``method`` on every worker up (a long deadline: level 1 copies the weights, and
        waking captures the CUDA graphs again): the answers of those that did. On a refusal,
        ``undo`` on those it succeeded on, then raise it. A worker that stopped answering is
        marked down, not an error."""
        workers = [w for w in self.workers if w.healthy]
        results = await asyncio.gather(
            *(getattr(w.stub, method)(request, timeout=600.0) for w in workers),
            return_exceptions=True,
        )
        failed = [
            (w, r) for w, r in zip(workers, results, strict=True)
            if isinstance(r, BaseException)
            and not (isinstance(r, grpc.aio.AioRpcError) and self._went_down(w, r))
        ]  # fmt: skip
        if not failed:
            return [r for r in results if not isinstance(r, BaseException)]
        if undo is not None:
            done = [
                w for w, r in zip(workers, results, strict=True) if not isinstance(r, Exception)
            ]
            await asyncio.gather(
                *(getattr(w.stub, undo[0])(undo[1], timeout=600.0) for w in done),
                return_exceptions=True,
            )
        worker, error = failed[0]
        if isinstance(error, grpc.aio.AioRpcError):
            raise rpc_error(error, worker.addr) from error
        raise error

    async def reset_prefix_cache(self) -> list[str]:
        """Have every worker up forget its prefix cache (the kvstore hears of each block
        removed); the addresses of those that did not (requests or KV leases hold blocks, or
        it stopped answering: it is marked down)."""
        request = engine_pb2.ResetPrefixCacheRequest()
        workers = [w for w in self.workers if w.healthy]
        results = await asyncio.gather(
            *(w.stub.ResetPrefixCache(request, timeout=30.0) for w in workers),
            return_exceptions=True,
        )
        missed = []
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError) and not self._went_down(worker, result):
                raise rpc_error(result, worker.addr) from result
            if isinstance(result, BaseException) and not isinstance(result, grpc.aio.AioRpcError):
                raise result
            if isinstance(result, BaseException) or not result.reset:
                missed.append(worker.addr)
        return missed

    def _went_down(self, worker: Worker, error: BaseException) -> bool:
        """Whether ``error`` says that ``worker`` stopped answering (it is marked down)."""
        if isinstance(error, grpc.aio.AioRpcError) and error.code() in _DOWN_CODES:
            self._mark_down(worker, error.code().name)
            return True
        return False

    async def _restore_adapters(self, worker: Worker) -> bool:
        """Before ``worker`` is routed to again (restarted, or new): have it serve the LoRA
        adapters loaded at run time and not those unloaded. False if it stopped answering
        (it stays down; the next poll tries again). An adapter it refuses is logged and left
        out: the worker serves the rest."""
        if not self._loaded_adapters and not self._unloaded_adapters:
            return True
        try:
            pb = await worker.stub.GetModelInfo(codec.get_model_info_request(), timeout=5.0)
            worker.info = codec.model_info(pb)
            served = dict(worker.info.lora_modules)
            calls: list[tuple[str, Any]] = [
                ("unload", engine_pb2.UnloadLoRAAdapterRequest(lora_name=name))
                for name, path in served.items()
                if name in self._unloaded_adapters
                or self._loaded_adapters.get(name, path) != path  # (loaded again elsewhere)
            ]
            calls += [
                ("load", engine_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
                for name, path in self._loaded_adapters.items()
                if served.get(name) != path
            ]
            for verb, request in calls:
                try:
                    if verb == "load":
                        await worker.stub.LoadLoRAAdapter(request, timeout=120.0)
                    else:
                        await worker.stub.UnloadLoRAAdapter(request, timeout=30.0)
                except grpc.aio.AioRpcError as e:
                    if e.code() in _DOWN_CODES:
                        raise
                    logger.error(
                        "%s worker %s: cannot %s LoRA adapter %r: %s",
                        worker.role, worker.addr, verb, request.lora_name, e.details(),
                    )  # fmt: skip
                else:
                    logger.info(
                        "%s worker %s: %sed LoRA adapter %r (runtime LoRA updating)",
                        worker.role, worker.addr, verb, request.lora_name,
                    )  # fmt: skip
        except grpc.aio.AioRpcError as e:
            self._mark_down(worker, e.code().name)
            return False
        return True

    @property
    def healthy(self) -> bool:
        return any(w.healthy for w in self.of_role(DECODE))

    async def connect(self, timeout_s: float = 60.0) -> ModelInfo:
        """Wait until every worker named on the command line answers ``GetModelInfo`` (and,
        with a kvstore, until at least one decode worker is known), start polling, and return
        the first decode worker's model info.

        Raises GatewayError (503) naming the workers that never answered.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last_error: dict[str, str] = {}
        while True:
            if self.kvstore is not None:
                await self._discover()
            pending = [w for w in self.workers if w.info is None]
            for worker in pending:
                await self._fetch_info(worker, max(0.1, deadline - loop.time()), last_error)
            pending = [w for w in self.workers if w.info is None and w.static]
            decode_ready = [w for w in self.of_role(DECODE) if w.info is not None]
            if not pending and decode_ready:
                break
            if loop.time() >= deadline:
                why = "; ".join(f"{w.addr} ({last_error.get(w.addr, '?')})" for w in pending)
                raise GatewayError(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    f"workers did not answer: {why or 'no decode worker registered'}",
                )
            await asyncio.sleep(0.2)
        infos = {w.info.max_model_len for w in self.workers if w.info is not None}
        if len(infos) > 1:
            logger.warning("workers disagree on max_model_len: %s", sorted(infos))
        first = decode_ready[0].info
        assert first is not None
        self.block_size = first.block_size
        self._poller = asyncio.create_task(self._poll())
        return first

    async def _fetch_info(self, worker: Worker, timeout: float, errors: dict[str, str]) -> None:
        try:
            pb = await worker.stub.GetModelInfo(codec.get_model_info_request(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            errors[worker.addr] = f"{e.code().name}: {e.details()}"
            return
        worker.info, worker.healthy = codec.model_info(pb), True

    async def _discover(self) -> None:
        """Sync the worker list with the kvstore's directory."""
        try:
            listed = await self.kvstore.list_workers()
        except Exception as e:  # the kvstore is down: keep the workers we know
            logger.debug("kvstore unavailable: %s", e)
            return
        live = {(info.grpc_address, info.role): info for info in listed}
        known = {(w.addr, w.role): w for w in self.workers}
        for key, info in live.items():
            worker = known.get(key)
            if worker is None:
                logger.info("found %s worker %s (%s)", info.role, info.grpc_address, info.worker_id)
                self.workers.append(
                    _new_worker(
                        info.grpc_address, info.role, worker_id=info.worker_id, static=False
                    )
                )
            else:
                worker.worker_id = info.worker_id
        for worker in list(self.workers):
            # Gone from the directory and not answering either: drop it. One that still answers
            # stays (the directory may be rebuilding, e.g. after a Redis restart).
            gone = (worker.addr, worker.role) not in live and not worker.healthy
            if not worker.static and gone and worker.num_inflight == 0:
                logger.warning("%s worker %s left the directory", worker.role, worker.addr)
                self.workers.remove(worker)
                self._spawn(worker.channel.close())

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.kvstore is not None:
                await self._discover()
                for worker in [w for w in self.workers if w.info is None]:
                    await self._fetch_info(worker, 1.0, {})
                    if worker.healthy and not await self._restore_adapters(worker):
                        worker.healthy = False
            workers = list(self.workers)
            results = await asyncio.gather(
                *(w.stub.GetLoad(codec.get_load_request(), timeout=1.0) for w in workers),
                return_exceptions=True,
            )
            now = loop.time()
            for worker, result in zip(workers, results, strict=True):
                if isinstance(result, engine_pb2.GetLoadResponse):
                    if not worker.healthy:
                        if worker.info is not None and not await self._restore_adapters(worker):
                            continue
                        logger.info("%s worker %s is serving", worker.role, worker.addr)
                    worker.load, worker.load_time = codec.worker_load(result), now
                    worker.healthy = worker.info is not None
                else:
                    self._mark_down(worker, result)
            await asyncio.sleep(self._poll_interval_s)

    def _mark_down(self, worker: Worker, why: object) -> None:
        if worker.healthy:
            logger.warning("%s worker %s is not answering: %s", worker.role, worker.addr, why)
        worker.healthy = False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- routing -------------------------------------------------------------------------------

    async def _cached_blocks(
        self, prompt: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> dict[str, int]:
        """Leading prompt blocks each worker caches (by address), from the prefix index (under
        the LoRA adapter ``lora_name`` and the ``cache_salt``: its blocks are hashed from a root
        of those)."""
        if self.kvstore is None or len(prompt) < self.block_size:
            return {}
        root = prefix_root(lora_name, cache_salt)
        hashes = [h.hash_value for h in hash_request_tokens(prompt, self.block_size, root=root)]
        try:
            matches = await self.kvstore.lookup_prefix(hashes, None)
        except Exception as e:
            logger.debug("prefix lookup failed: %s", e)
            return {}
        by_id = {w.worker_id: w.addr for w in self.workers if w.worker_id}
        return {by_id[m.worker_id]: m.num_blocks for m in matches if m.worker_id in by_id}

    def _pick(
        self, role: str, num_tokens: int, cached: dict[str, int], exclude: Iterable[Worker] = ()
    ) -> tuple[Worker, int] | None:
        """The healthy worker of ``role`` with the lowest cost, and its uncached token count;
        ties round robin. None when no healthy worker is left."""
        now = asyncio.get_running_loop().time()
        excluded = set(map(id, exclude))
        candidates = [w for w in self.of_role(role) if w.healthy and id(w) not in excluded]
        if role == PREFILL:
            candidates = [w for w in candidates if w.has_room(now)]
        if not candidates:
            return None
        start = next(self._round_robin) % len(candidates)
        rotated = candidates[start:] + candidates[:start]

        def uncached(w: Worker) -> int:
            return max(0, num_tokens - cached.get(w.addr, 0) * self.block_size)

        best = min(rotated, key=lambda w: uncached(w) + self.load_weight * w.num_requests(now))
        return best, uncached(best)

    async def route(
        self,
        prompt: Sequence[int],
        exclude: Iterable[Worker] = (),
        local_only: bool = False,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        num_tokens: int | None = None,
    ) -> RouteDecision:
        """Where ``prompt`` runs. ``num_tokens``: its length if not ``prompt``'s (a prompt
        given as embeddings: no tokens to look up)."""
        num_tokens = len(prompt) if num_tokens is None else num_tokens
        worth = self._worth_lookup(prompt)
        cached = await self._cached_blocks(prompt, lora_name, cache_salt) if worth else {}
        picked = self._pick(DECODE, num_tokens, cached, exclude)
        if picked is None:
            raise GatewayError(HTTPStatus.SERVICE_UNAVAILABLE, "no decode worker is available")
        decode, num_uncached = picked
        if local_only:  # prompt logprobs: only local prefill computes them
            return RouteDecision(decode, None, "local_prompt_logprobs", num_uncached)
        if num_uncached <= self.remote_prefill_threshold:
            return RouteDecision(decode, None, "local_cached", num_uncached)
        if not self.of_role(PREFILL):
            return RouteDecision(decode, None, "local_no_prefill_worker", num_uncached)
        prefill = self._pick(PREFILL, num_tokens, cached)
        if prefill is None:
            return RouteDecision(decode, None, "local_prefill_busy", num_uncached)
        if self._prefill_queue_too_long(prefill[0], decode):
            return RouteDecision(decode, None, "local_prefill_queue", num_uncached)
        return RouteDecision(decode, prefill[0], "remote", num_uncached)

    def _prefill_queue_too_long(self, prefill: Worker, decode: Worker) -> bool:
        """Whether the prompt would wait longer than ``max_remote_prefill_wait_s`` in the
        prefill worker's queue while the decode worker has less prefill queued."""
        limit = self.max_remote_prefill_wait_s
        if limit is None or decode.backlog.pending >= prefill.backlog.pending:
            return False
        return prefill.backlog.wait_s() > limit

    def _worth_lookup(self, prompt: Sequence[int]) -> bool:
        """Whether the prefix index can change this prompt's route: with one decode worker, a
        prompt within the remote-prefill threshold is prefilled locally whatever it caches."""
        if self.kvstore is None:
            return False
        several = len(self.of_role(DECODE)) > 1
        return several or len(prompt) > self.remote_prefill_threshold

    # --- one sequence --------------------------------------------------------------------------

    async def generate(
        self, request: engine_pb2.GenerateRequest, trace_parent: tracing.Context | None = None
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Run ``request`` (one sequence) and yield its chunks as they arrive.

        Closing the generator (or cancelling the task iterating it) cancels the open gRPC call,
        which aborts the request on its worker, and aborts a remote prefill's KV lease. Raises
        GatewayError for a failed call. Spans (route, prefill, decode) go under ``trace_parent``.
        """
        span = tracing.start_span("route", trace_parent)
        try:
            route = await self.route(
                request.prompt_token_ids,
                local_only=request.sampling.HasField("prompt_logprobs"),
                lora_name=request.lora_name or None,
                cache_salt=request.cache_salt or None,
                num_tokens=codec.num_prompt_tokens(request),
            )
        except GatewayError as e:
            tracing.end_span(span, e)
            raise
        span.set_attribute("baton.decision", route.reason)
        span.set_attribute("baton.decode_worker", route.decode.addr)
        span.set_attribute("baton.uncached_tokens", route.num_uncached_tokens)
        if route.prefill is not None:
            span.set_attribute("baton.prefill_worker", route.prefill.addr)
        tracing.end_span(span)
        self._on_decision(route.reason)
        prefill_worker: Worker | None = None
        decode_request = request
        finished = False
        # a prompt the decode worker prefills counts in its backlog until its first token
        local_backlog: Worker | None = None
        num_prompt = codec.num_prompt_tokens(request)
        loop = asyncio.get_running_loop()
        try:
            if route.prefill is not None:
                prefilled = await self._prefill(request, route.prefill, trace_parent)
                if prefilled is not None:
                    prefill_worker, response = prefilled
                    chunk = codec.prefill_chunk(response, request)
                    yield chunk
                    if chunk.finish_reason is not None:
                        finished = True  # nothing is held on the prefill worker
                        return
                    decode_request = codec.remote_generate_request(request, response)
            if prefill_worker is None:
                local_backlog = route.decode
                local_backlog.backlog.add(num_prompt, loop.time())
            decode = self._decode(decode_request, route.decode, trace_parent)
            async with aclosing(decode) as chunks:
                async for chunk in chunks:
                    if local_backlog is not None:
                        local_backlog.backlog.remove(num_prompt, loop.time(), completed=True)
                        local_backlog = None
                    yield chunk
                    if chunk.finish_reason is not None:
                        finished = True
        finally:
            if local_backlog is not None:
                local_backlog.backlog.remove(num_prompt, loop.time(), completed=False)
            if prefill_worker is not None and not finished:
                # The decode worker may never pull: let the prefill worker free the KV now.
                self._spawn(self._abort(prefill_worker, request.req_id))

    async def _prefill(
        self,
        request: engine_pb2.GenerateRequest,
        first: Worker,
        trace_parent: tracing.Context | None,
    ) -> tuple[Worker, engine_pb2.PrefillResponse] | None:
        """Prefill on ``first`` or, if it fails, another prefill worker; None: prefill locally."""
        tried: list[Worker] = []
        worker: Worker | None = first
        num_prompt = codec.num_prompt_tokens(request)
        loop = asyncio.get_running_loop()
        while worker is not None:
            tried.append(worker)
            worker.num_inflight += 1
            worker.backlog.add(num_prompt, loop.time())
            completed = False
            span = tracing.start_span(
                "prefill", trace_parent, tracing.SpanKind.CLIENT, {"baton.worker": worker.addr}
            )
            try:
                metadata = tracing.inject(tracing.context_with(span))
                response = await worker.stub.Prefill(
                    codec.prefill_request(request), metadata=metadata
                )
                completed = True
                tracing.end_span(span)
                return worker, response
            except grpc.aio.AioRpcError as e:
                tracing.end_span(span, e.code().name)
                if e.code() not in _RETRYABLE:
                    raise rpc_error(e, worker.addr) from e
                logger.warning("prefill on %s failed (%s); trying elsewhere", worker.addr, e.code())
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._mark_down(worker, e.code().name)
                self._on_decision("prefill_retry")
            finally:
                worker.num_inflight -= 1
                worker.backlog.remove(num_prompt, loop.time(), completed)
            picked = self._pick(PREFILL, num_prompt, {}, tried)
            worker = picked[0] if picked else None
        self._on_decision("local_prefill_failed")
        return None

    async def _decode(
        self,
        request: engine_pb2.GenerateRequest,
        first: Worker,
        trace_parent: tracing.Context | None,
    ) -> AsyncGenerator[GenerateChunk, None]:
        tried: list[Worker] = []
        next_worker: Worker | None = first
        while next_worker is not None:
            worker, next_worker = next_worker, None
            tried.append(worker)
            worker.num_inflight += 1
            span = tracing.start_span(
                "decode", trace_parent, tracing.SpanKind.CLIENT, {"baton.worker": worker.addr}
            )
            error: str | None = "cancelled"
            assert worker.streams is not None
            call = worker.streams.generate(request, tracing.inject(tracing.context_with(span)))
            streamed = False
            try:
                async for pb in call:
                    streamed = True
                    yield codec.generate_chunk(pb)
                error = None
                return
            except grpc.aio.AioRpcError as e:
                error = e.code().name
                if streamed or e.code() not in _RETRYABLE:
                    raise rpc_error(e, worker.addr) from e
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._mark_down(worker, e.code().name)
                picked = self._pick(DECODE, codec.num_prompt_tokens(request), {}, tried)
                if picked is None:
                    raise rpc_error(e, worker.addr) from e
                next_worker = picked[0]
                logger.warning(
                    "decode worker %s failed before its first token (%s); retrying on %s",
                    worker.addr,
                    e.code().name,
                    next_worker.addr,
                )
                self._on_decision("decode_retry")
            finally:
                worker.num_inflight -= 1
                call.cancel()  # a no-op when the call has already ended
                tracing.end_span(span, error)

    # --- embeddings ------------------------------------------------------------------------------

    async def embed(
        self, request: engine_pb2.EmbedRequest, trace_parent: tracing.Context | None = None
    ) -> list[codec.Embedded]:
        """Run ``request`` on one decode worker: the cheapest for its first input (prefix
        cache and load, as ``route`` weighs them), or, if that one is full or gone before it
        answers, the next. Raises GatewayError for a failed call."""
        first = request.inputs[0].token_ids
        worth = self._worth_lookup(first)
        cached = await self._cached_blocks(first, request.lora_name or None) if worth else {}
        tried: list[Worker] = []
        picked = self._pick(DECODE, len(first), cached)
        if picked is None:
            raise GatewayError(HTTPStatus.SERVICE_UNAVAILABLE, "no decode worker is available")
        while True:
            worker = picked[0]
            tried.append(worker)
            worker.num_inflight += 1
            span = tracing.start_span(
                "embed", trace_parent, tracing.SpanKind.CLIENT, {"baton.worker": worker.addr}
            )
            error: str | None = "cancelled"
            try:
                metadata = tracing.inject(tracing.context_with(span))
                response = await worker.stub.Embed(request, metadata=metadata)
                error = None
                return codec.embedded(response)
            except grpc.aio.AioRpcError as e:
                error = e.code().name
                if e.code() not in _RETRYABLE:
                    raise rpc_error(e, worker.addr) from e
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._mark_down(worker, e.code().name)
                picked = self._pick(DECODE, len(first), {}, tried)
                if picked is None:
                    raise rpc_error(e, worker.addr) from e
                logger.warning(
                    "embed on %s failed (%s); retrying on %s",
                    worker.addr,
                    e.code().name,
                    picked[0].addr,
                )
            finally:
                worker.num_inflight -= 1
                tracing.end_span(span, error)

    async def _abort(self, worker: Worker, req_id: str) -> None:
        try:
            await worker.stub.Abort(codec.abort_request([req_id]), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            logger.debug("abort of %s on %s failed: %s", req_id, worker.addr, e.code())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(
            *(w.streams.close() for w in self.workers if w.streams is not None),
            return_exceptions=True,
        )
        await asyncio.gather(*(w.channel.close() for w in self.workers), return_exceptions=True)
        if self.kvstore is not None:
            await self.kvstore.close()
