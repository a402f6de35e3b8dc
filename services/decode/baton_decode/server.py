"""The engine workers' gRPC server: ``DecodeService`` (role decode) or ``PrefillService`` plus
``KVTransferService`` (role prefill), with ``grpc.health.v1``, Prometheus metrics and, when a
kvstore is configured, registration, heartbeats and KV events.

Capacity: a worker holds at most ``max_pending`` requests (accepted, not finished: engine
running + waiting, plus any handed over during the current step); one more is answered
RESOURCE_EXHAUSTED so the gateway can route it elsewhere instead of queueing it here. The
default, 4 x ``max_num_seqs``, keeps enough queued to refill the batch as requests finish while
bounding how long a request can sit in the queue.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING and new requests (``Generate`` calls,
or requests sent on a ``GenerateStream`` call) get UNAVAILABLE; in-flight requests get
``shutdown_grace_s`` to finish (a second signal cuts that short); the rest end with finish
reason ABORT; then the server stops and ``serve`` returns 0. A dead engine stops the worker the
same way, and ``serve`` returns 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from baton import tracing
from baton.addresses import grpc_address, url_host
from baton.v1 import engine_pb2, engine_pb2_grpc
from baton_decode import codec
from baton_decode.engine_loop import EngineLoop, EngineThread, RequestStream
from baton_decode.errors import (
    DuplicateRequestError,
    EngineDeadError,
    WorkerFullError,
)
from baton_decode.kv_puller import KVPuller, RemoteKV, StagingArea, check_block_hashes
from baton_decode.metrics import WorkerMetrics
from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore, check_pause_mode
from baton_engine.core.outputs import EngineCoreOutput, KVLoad
from baton_engine.errors import (
    BatonError,
    EngineBusyError,
    EngineSleepingError,
    InvalidRequestError,
    NotFoundError,
)
from baton_engine.model_files import served_model_name
from baton_kvstore.client import KVStoreClient, WorkerRegistration
from baton_kvstore.codec import WorkerInfo, WorkerLoad
from baton_kvtransfer.compat import compat_hash
from baton_kvtransfer.leases import LeaseTable
from baton_kvtransfer.nixl_agent import resolve_backend
from baton_kvtransfer.sink import KVTransferSink
from baton_kvtransfer.source import KVTransferSource

logger = logging.getLogger(__name__)

# The largest request a worker takes: a prompt's embeddings of 64k positions by a hidden size of
# 4096 in float32 fit.
MAX_REQUEST_BYTES = 1 << 30

# A worker split across ranks moves KV through whole-head blocks for this many requests of
# max_model_len: a decode worker stages what it pulls, a prefill worker exports its prompts.
_STAGING_REQUESTS = 2

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
PREFILL_SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
_STOP_GRACE_S = 1.0  # for the last (ABORT) messages to leave once every request has ended


@dataclass(frozen=True)
class WorkerConfig:
    """The worker's own knobs (the engine's are in ``EngineConfig``)."""

    role: str = "decode"  # "decode" | "prefill"
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (printed in the ready line)
    metrics_port: int = 0  # 0: any free port (reported by GetModelInfo.metrics_url)
    served_model_name: str | None = None  # None: the model argument, or the default model's name
    max_pending: int | None = None  # None: 4 * max_num_seqs
    shutdown_grace_s: float = 5.0
    log_stats_interval_s: float = 5.0
    metric_names: str = "baton"  # the engine metrics' prefix: "baton" or "vllm"
    worker_id: str | None = None  # None: role-host-port
    kvstore_address: str | None = None  # register and publish KV events there
    kv_transfer: str = "auto"  # "nixl" | "grpc" | "auto"
    kv_load_failure_policy: str = "recompute"  # "recompute" | "fail" (decode)
    kv_lease_ms: int = 30_000  # how long a prefilled prompt's blocks wait for their pull
    otlp_endpoint: str | None = None  # None: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or no tracing


def status_code(error: BatonError) -> grpc.StatusCode:
    if isinstance(error, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(error, NotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, EngineSleepingError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, WorkerFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class WorkerInfoMixin:
    """What both roles' servicers answer the same way: ``GetLoad``, ``GetModelInfo``, the LoRA
    adapters' loading and unloading, ``ResetPrefixCache`` and sleep mode."""

    engine: EngineLoop
    served_model_name: str
    metrics_url: str
    # Sleep mode: what else holds the KV pool's memory (the KV transfer's NIXL registration)
    # lets go before the engine frees it, and takes it again once it is back (_Role sets them).
    release_kv_memory: Callable[[], None] | None = None
    restore_kv_memory: Callable[[], None] | None = None
    on_sleep_level: Callable[[int], None] | None = None  # (the sleep-state metric)
    profile_prefix: str | None = None  # the traces' names start with it (the worker's id)

    async def GetLoad(
        self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.GetLoadResponse:
        engine = self.engine
        return codec.load_to_proto(
            engine.stats, engine.num_pending, engine.core.config.max_num_seqs
        )

    async def GetModelInfo(
        self, request: engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.GetModelInfoResponse:
        return codec.model_info_to_proto(self.engine.core, self.served_model_name, self.metrics_url)

    async def LoadLoRAAdapter(
        self,
        request: engine_pb2.LoadLoRAAdapterRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> engine_pb2.LoadLoRAAdapterResponse:
        name, path = request.lora_name, request.lora_path
        try:
            if not name or not path:
                raise InvalidRequestError("both lora_name and lora_path are required")
            await self.engine.call(lambda core: core.load_lora_adapter(name, path))
        except BatonError as e:
            await context.abort(status_code(e), str(e))
        logger.info("serving LoRA adapter %s from %s", name, path)
        return engine_pb2.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(
        self,
        request: engine_pb2.UnloadLoRAAdapterRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> engine_pb2.UnloadLoRAAdapterResponse:
        name = request.lora_name
        try:
            await self.engine.call(lambda core: core.unload_lora_adapter(name))
        except BatonError as e:
            await context.abort(status_code(e), str(e))
        logger.info("no longer serving LoRA adapter %s", name)
        return engine_pb2.UnloadLoRAAdapterResponse()

    async def ResetPrefixCache(
        self,
        request: engine_pb2.ResetPrefixCacheRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> engine_pb2.ResetPrefixCacheResponse:
        try:
            reset = await self.engine.call(lambda core: core.reset_prefix_cache())
        except BatonError as e:
            await context.abort(status_code(e), str(e))
        if reset:
            logger.info("prefix cache reset")
        else:
            logger.warning("prefix cache not reset: requests or KV leases hold blocks")
        return engine_pb2.ResetPrefixCacheResponse(reset=reset)

    async def Sleep(
        self, request: engine_pb2.SleepRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.SleepResponse:
        level = request.level if request.HasField("level") else 1  # (vLLM's defaults)
        mode = request.mode or "abort"
        try:
            check_pause_mode(mode)
            if level == 0:  # (a pause until WakeUp; refused where sleep mode is off)
                await self.engine.call(lambda core: core.check_sleep(0))
                await self._pause(mode)
            else:
                await self._sleep_once_idle(level, mode)
        except BatonError as e:
            await context.abort(status_code(e), str(e))
        return engine_pb2.SleepResponse()

    async def _sleep_once_idle(self, level: int, mode: str) -> None:
        """Refuse new requests, abort those in flight, let them finish, or keep them (``mode``),
        and sleep once the engine is idle (held prompt blocks pulled or expired too)."""
        engine = self.engine
        keep = mode == "keep"
        if not await engine.call(lambda core: core.check_sleep(level, busy_ok=True)):
            return  # (asleep already)
        engine.closing = "the engine is going to sleep"
        was_paused = False
        try:
            if keep:  # (the step in flight reports; the kept requests' blocks are freed later)
                was_paused = await engine.call(_pause_keeping)
            elif mode == "abort":
                engine.abort_all()
            while True:
                try:
                    if not await engine.call(lambda core: core.check_sleep(level, keep=keep)):
                        return
                except EngineBusyError:
                    await asyncio.sleep(0.02)
                    continue
                break
            if self.release_kv_memory is not None:
                self.release_kv_memory()
            try:
                await engine.call(lambda core: core.sleep(level, keep))
            except BaseException:  # (awake, as before)
                if self.restore_kv_memory is not None:
                    self.restore_kv_memory()
                raise
            if self.on_sleep_level is not None:
                self.on_sleep_level(level)
        except BaseException:
            if keep and not was_paused:
                await engine.call(lambda core: core.resume())
            raise
        finally:
            engine.closing = None

    async def Pause(
        self, request: engine_pb2.PauseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.PauseResponse:
        mode = request.mode or "abort"
        try:
            check_pause_mode(mode)
            await self._pause(mode)
            if request.clear_cache and mode != "keep":  # (vLLM ignores it with keep)
                while not await self.engine.call(lambda core: core.reset_prefix_cache()):
                    await asyncio.sleep(0.05)  # (prefilled prompts' blocks wait for their pull)
        except BatonError as e:
            await context.abort(status_code(e), str(e))
        return engine_pb2.PauseResponse()

    async def _pause(self, mode: str) -> None:
        """Hold new requests until ``Resume`` and abort, wait for or keep those in flight."""
        engine = self.engine
        in_flight = engine.request_ids()  # (added before the pause below: it queues after them)
        await engine.call(lambda core: core.pause(keep=mode == "keep"))
        logger.info("paused (mode %s, %d requests in flight)", mode, len(in_flight))
        if mode == "abort":
            engine.abort(in_flight)
        if mode != "keep":
            while not await engine.call(lambda core: core.drained()):
                await asyncio.sleep(0.02)

    async def Resume(
        self, request: engine_pb2.ResumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.ResumeResponse:
        if await self.engine.call(_resume):
            logger.info("resumed")
        return engine_pb2.ResumeResponse()

    async def IsPaused(
        self, request: engine_pb2.IsPausedRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.IsPausedResponse:
        paused = await self.engine.call(lambda core: core.is_paused())
        return engine_pb2.IsPausedResponse(is_paused=paused)

    async def WakeUp(
        self, request: engine_pb2.WakeUpRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.WakeUpResponse:
        tags = list(request.tags) or None
        try:
            was, asleep = await self.engine.call(lambda core: _wake(core, tags))
        except BatonError as e:
            await context.abort(status_code(e), str(e))
        if was and not asleep:
            if self.restore_kv_memory is not None:
                self.restore_kv_memory()
            if self.on_sleep_level is not None:
                self.on_sleep_level(0)
        return engine_pb2.WakeUpResponse(is_sleeping=asleep)

    async def StartProfile(
        self, request: engine_pb2.StartProfileRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.StartProfileResponse:
        prefix = request.prefix or self.profile_prefix
        try:
            await self.engine.call(lambda core: core.start_profile(prefix))
        except BatonError as e:
            await context.abort(status_code(e), str(e))
        return engine_pb2.StartProfileResponse()

    async def StopProfile(
        self, request: engine_pb2.StopProfileRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.StopProfileResponse:
        try:
            await self.engine.call(lambda core: core.stop_profile())
        except BatonError as e:
            await context.abort(status_code(e), str(e))
        return engine_pb2.StopProfileResponse()

    async def ReloadWeights(
        self, request: engine_pb2.ReloadWeightsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.ReloadWeightsResponse:
        try:
            await self.engine.call(lambda core: core.reload_weights())
        except BatonError as e:
            await context.abort(status_code(e), str(e))
        ranks = self.engine.core.config.tensor_parallel_size
        return engine_pb2.ReloadWeightsResponse(num_ranks=ranks)

    async def IsSleeping(
        self, request: engine_pb2.IsSleepingRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.IsSleepingResponse:
        asleep = await self.engine.call(lambda core: core.is_sleeping())
        return engine_pb2.IsSleepingResponse(is_sleeping=asleep)


def _pause_keeping(core: EngineCore) -> bool:
    """``core.pause(keep=True)``; whether it was paused before."""
    was = core.is_paused()
    core.pause(keep=True)
    return was


def _resume(core: EngineCore) -> bool:
    """``core.resume()``; whether it was paused."""
    was = core.is_paused()
    core.resume()
    return was


def _wake(core: EngineCore, tags: list[str] | None) -> tuple[bool, bool]:
    """``core.wake_up(tags)``; whether a part was asleep before, and is still."""
    was = core.is_sleeping()
    core.wake_up(tags)
    return was, core.is_sleeping()


class _CallRequests:
    """The requests of one ``GenerateStream`` call, on the asyncio loop: which are live, which
    have news since the call's last message (``news`` is set when any has)."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[RequestStream, tracing.Span]] = {}
        self._ready: dict[str, None] = {}  # req_ids with queued outputs, in arrival order
        self._refused: list[engine_pb2.GenerateStreamItem] = []
        self.news = asyncio.Event()

    def add(self, stream: RequestStream, span: tracing.Span) -> None:
        self.live[stream.req_id] = (stream, span)
        stream.on_put = self._on_put
        if not stream.queue.empty():
            self._on_put(stream)

    def refused(self, req_id: str, code: grpc.StatusCode, message: str) -> None:
        self._refused.append(_error_item(req_id, code, message))
        self.news.set()

    def _on_put(self, stream: RequestStream) -> None:
        self._ready[stream.req_id] = None
        self.news.set()

    def take_items(self) -> list[engine_pb2.GenerateStreamItem]:
        """One item per request with new outputs (and one per error), ending finished ones."""
        items, self._refused = self._refused, []
        ready, self._ready = self._ready, {}
        for req_id in ready:
            entry = self.live.get(req_id)
            if entry is None:
                continue
            stream = entry[0]
            outputs, error = stream.take_nowait()
            if outputs:
                response = codec.generate_response_to_proto(outputs, stream.num_prompt_tokens)
                items.append(engine_pb2.GenerateStreamItem(req_id=req_id, response=response))
            if error is not None:
                items.append(_error_item(req_id, status_code(error), str(error)))
                self._end(req_id, error)
            elif outputs and outputs[-1].finish_reason is not None:
                self._end(req_id, None)
        return items

    def _end(self, req_id: str, error: BaseException | str | None) -> None:
        _, span = self.live.pop(req_id)
        tracing.end_span(span, error)

    def end_all(self, why: str) -> None:
        for req_id in list(self.live):
            self._end(req_id, why)


def _error_item(req_id: str, code: grpc.StatusCode, message: str) -> engine_pb2.GenerateStreamItem:
    return engine_pb2.GenerateStreamItem(
        req_id=req_id, error_code=code.value[0], error_message=message
    )


class DecodeServicer(WorkerInfoMixin, engine_pb2_grpc.DecodeServiceServicer):
    """``DecodeService`` over one ``EngineLoop``; every method runs on the asyncio loop."""

    def __init__(
        self,
        engine: EngineLoop,
        *,
        served_model_name: str,
        metrics_url: str,
        compat_hash: bytes = b"",
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.metrics_url = metrics_url
        self.compat_hash = compat_hash  # whose KV this worker can use
        self.block_size = engine.core.config.block_size
        self.draining = False

    async def _admit(
        self, request: engine_pb2.GenerateRequest, metadata: Any
    ) -> tuple[RequestStream, tracing.Span]:
        """Validate and queue one request; ``metadata`` carries its trace context. Raises
        BatonError (the span ended with it) if it is refused."""
        span = tracing.start_span(
            "decode worker",
            tracing.extract(metadata),
            tracing.SpanKind.SERVER,
            {"baton.req_id": request.req_id, "baton.remote_prefill": request.HasField("kv_handle")},
        )
        try:
            if self.draining:
                raise EngineDeadError("the worker is shutting down")
            inp = codec.generate_input_from_proto(request)
            if inp.prompt_embeds is not None:
                # (hashing a long prompt's rows would hold the loop up)
                embeds, ids = await asyncio.to_thread(
                    self.engine.core.embeds_prompt, inp.prompt_embeds
                )
                inp = dataclasses.replace(inp, prompt_token_ids=ids, prompt_embeds=embeds)
            remote = None
            if inp.kv_handle is not None:
                # An incompatible engine's handle (other block size, dtype, model) is not
                # checked here: the pull refuses it and the prompt is recomputed.
                if inp.kv_handle.compat_hash == self.compat_hash:
                    check_block_hashes(
                        inp.prompt_token_ids,
                        inp.kv_handle,
                        self.block_size,
                        inp.lora_name,
                        inp.cache_salt,
                    )
                remote = RemoteKV(inp.kv_handle, tracing.context_with(span))
            await self.engine.compile_grammar(inp.params)
            stream = self.engine.add_request(
                inp.req_id,
                inp.prompt_token_ids,
                inp.params,
                remote_kv=remote,
                first_token_id=inp.first_token_id,
                priority=inp.priority,
                lora_name=inp.lora_name,
                cache_salt=inp.cache_salt,
                prompt_embeds=inp.prompt_embeds,
            )
        except BatonError as e:
            tracing.end_span(span, e)
            raise
        return stream, span

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """Stream the request's tokens; each message carries every token sampled since the
        previous one. The call ending early for any reason (client cancel, deadline, error)
        aborts the request in the engine, which frees its blocks."""
        try:
            stream, span = await self._admit(request, context.invocation_metadata())
        except BatonError as e:
            await context.abort(status_code(e), str(e))
            return
        finished = False
        try:
            while not finished:
                try:
                    outputs = await stream.next_batch()
                except BatonError as e:
                    finished = True  # the engine already dropped it
                    await context.abort(status_code(e), str(e))
                    return
                finished = outputs[-1].finish_reason is not None
                yield codec.generate_response_to_proto(outputs, stream.num_prompt_tokens)
        finally:
            if not finished:
                self.engine.abort([stream.req_id])
            tracing.end_span(span, None if finished else "cancelled")

    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[engine_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[engine_pb2.GenerateStreamResponse]:
        """Many requests over one call: one response message per engine step with every
        request's news (``_CallRequests``). The call ends once the client has sent everything
        and every request has ended; ending it early aborts the requests still running."""
        call = _CallRequests()
        reader = asyncio.create_task(self._read_stream_requests(request_iterator, call))
        try:
            while True:
                await call.news.wait()
                call.news.clear()
                items = call.take_items()
                if items:
                    yield engine_pb2.GenerateStreamResponse(items=items)
                if reader.done():
                    reader.result()  # the client's side failed: end the call with that
                    if not call.live:
                        return
        finally:
            reader.cancel()
            if call.live:
                self.engine.abort(list(call.live))
            call.end_all("cancelled")

    async def _read_stream_requests(
        self, request_iterator: AsyncIterator[engine_pb2.GenerateStreamRequest], call: _CallRequests
    ) -> None:
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "generate":
                    req_id = message.generate.req_id
                    try:
                        stream, span = await self._admit(
                            message.generate, message.trace_context.items()
                        )
                    except BatonError as e:
                        call.refused(req_id, status_code(e), str(e))
                        continue
                    call.add(stream, span)
                elif kind == "cancel_req_id" and message.cancel_req_id in call.live:
                    self.engine.abort([message.cancel_req_id])
        finally:
            call.news.set()  # the writer decides whether the call is over

    async def Embed(
        self, request: engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.EmbedResponse:
        """Every input as an embedding request ("<req_id>-<i>"), answered once all are pooled
        (``_embed``); a refusal or failure ends the call with its status."""
        span = tracing.start_span(
            "decode worker embed",
            tracing.extract(context.invocation_metadata()),
            tracing.SpanKind.SERVER,
            {"baton.req_id": request.req_id, "baton.num_inputs": len(request.inputs)},
        )
        error: BaseException | str | None = "cancelled"
        try:
            response = await self._embed(request)
            error = None
            return response
        except BatonError as e:
            error = e
            await context.abort(status_code(e), str(e))
            raise  # (abort raised already)
        finally:
            tracing.end_span(span, error)

    async def _embed(self, request: engine_pb2.EmbedRequest) -> engine_pb2.EmbedResponse:
        """All inputs are validated before any runs. They are admitted as the worker has room:
        one that finds it full waits for an earlier input of the call to end, so a call of
        more inputs than ``max_pending`` still runs (``WorkerFullError`` only when none of its
        inputs fits). Leaving early (an error, the call cancelled) aborts the inputs still
        running."""
        if self.draining:
            raise EngineDeadError("the worker is shutting down")
        inputs, params = codec.embed_input_from_proto(request)
        lora = self.engine.core.lora_request(request.lora_name)
        for ids in inputs:
            self.engine.core.validate_request(ids, params, request.priority, lora)
        embeddings: dict[int, engine_pb2.Embedding] = {}
        running: dict[asyncio.Task[list[EngineCoreOutput]], tuple[int, str]] = {}
        admitted = 0
        try:
            while admitted < len(inputs) or running:
                while admitted < len(inputs):
                    req_id = f"{request.req_id}-{admitted}"
                    try:
                        stream = self.engine.add_request(
                            req_id,
                            inputs[admitted],
                            params,
                            priority=request.priority,
                            lora_name=request.lora_name,
                        )
                    except WorkerFullError:
                        if not running:
                            raise
                        break  # wait for one of ours to end
                    running[asyncio.ensure_future(stream.next_batch())] = (admitted, req_id)
                    admitted += 1
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i, _ = running.pop(task)
                    out = task.result()[-1]  # (raises the request's error)
                    if out.pooled is None:  # aborted: the worker is stopping
                        raise EngineDeadError("the worker is shutting down")
                    embeddings[i] = codec.embedding_to_proto(out, len(inputs[i]))
        finally:
            for task in running:
                task.cancel()
            if running:
                self.engine.abort([req_id for _, req_id in running.values()])
        return engine_pb2.EmbedResponse(embeddings=[embeddings[i] for i in range(len(inputs))])

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.AbortResponse:
        """End the named requests (their streams get a last message with finish reason ABORT);
        unknown ids are ignored."""
        return engine_pb2.AbortResponse(num_aborted=self.engine.abort(list(request.req_ids)))


def _set_process_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:  # optional: only makes `ps` output nicer
        return
    setproctitle.setproctitle(title)


def serve(engine_config: EngineConfig, config: WorkerConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, and return the exit status (0).

    Prints ``baton ROLE ready on HOST:PORT (metrics URL)`` on stdout once it serves; launchers
    wait for that line. Raises ``BatonError`` if the model cannot be loaded or the port bound.
    """
    if config.role not in ("decode", "prefill"):
        raise InvalidRequestError(f"role must be decode or prefill, got {config.role!r}")
    if config.kvstore_address:
        engine_config = dataclasses.replace(engine_config, enable_kv_events=True)
    # Built (for seconds) before the event loop runs, on the thread that will step it.
    engine_thread = EngineThread(lambda: EngineCore(engine_config))
    core = engine_thread.core()  # raises what the build raised (the thread has ended then)
    max_pending = config.max_pending or 4 * engine_config.max_num_seqs
    name = config.served_model_name or served_model_name(engine_config.model)
    tracing.setup(f"baton-{config.role}", config.otlp_endpoint)
    try:
        return asyncio.run(_serve(core, engine_thread, config, name, max_pending))
    finally:
        engine_thread.cancel()  # a no-op once the loop ran on it
        tracing.shutdown()


def engine_compat_hash(core: EngineCore) -> bytes:
    """What two workers must share for one's KV to be valid in the other's pool. KV moves as
    whole blocks of the unsharded model whatever either side's tensor-parallel size: a prefill
    worker split across ranks gathers a prompt's blocks from its ranks before it answers
    (``EngineCore.enable_kv_export``), and a split decode worker stages the blocks it pulls and
    gives each rank its heads. So the sizes do not enter, and any pair of them works."""
    mc = core.model_config
    # FP8 layers compute other K/V than the model's own weights (the key only where they are
    # on: the hashes of unquantized workers stay as they were)
    weights = {"weights": "fp8"} if core.runner.model.fp8_linears else {}
    return compat_hash(
        model=f"{mc.architecture}/{mc.num_layers}x{mc.hidden_size}/{mc.vocab_size}",
        dtype=str(core.runner.kv_dtype),  # (what the blocks hold: the model's, or FP8)
        block_size=core.config.block_size,
        layout=f"block-major/{core.whole_block_shape}",
        **weights,
    )


class _Role:
    """What differs between a decode and a prefill worker: servicer and KV transfer side."""

    def __init__(
        self,
        core: EngineCore,
        config: WorkerConfig,
        name: str,
        metrics: WorkerMetrics,
        metrics_url: str,
        address: str,
    ) -> None:
        self.config = config
        self.worker_id = config.worker_id or f"{config.role}-{address}"
        self.engine_id = uuid.uuid4().hex
        self.epoch = int(time.time() * 1000)
        self.compat = engine_compat_hash(core)
        self.metrics = metrics
        self.name = name
        self.metrics_url = metrics_url
        self.address = address
        self.backend = resolve_backend(config.kv_transfer)
        self.sink: KVTransferSink | None = None
        self.puller: KVPuller | None = None
        self.source: KVTransferSource | None = None
        self.leases: LeaseTable | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self.servicer: DecodeServicer | Any = None
        self._pool = core.kv_pool  # (sleep mode frees its memory)
        self._registered: torch.Tensor | None = None  # what the KV transfer registered

    def on_kv_load(self, load: KVLoad) -> None:
        assert self.puller is not None
        self.puller.start(load)

    def build(self, engine: EngineLoop, server: grpc.aio.Server) -> None:
        core = engine.core
        if self.config.role == "decode":
            staging = None
            if core.config.tensor_parallel_size > 1:
                rows = _STAGING_REQUESTS * -(core.max_model_len // -core.config.block_size)
                staging = StagingArea(
                    torch.empty(
                        (rows, *core.whole_block_shape),
                        dtype=core.kv_pool.dtype,
                        device=core.kv_pool.device,
                    )
                )
            self._registered = core.kv_pool if staging is None else staging.pool
            self.sink = KVTransferSink(
                self._registered,
                engine_id=self.engine_id,
                epoch=self.epoch,
                compat_hash=self.compat,
                backend=self.backend,
            )
            self.puller = KVPuller(
                engine,
                self.sink,
                compat_hash=self.compat,
                block_size=core.config.block_size,
                failure_policy=self.config.kv_load_failure_policy,
                metrics=self.metrics,
                staging=staging,
            )
            self.servicer = DecodeServicer(
                engine,
                served_model_name=self.name,
                metrics_url=self.metrics_url,
                compat_hash=self.compat,
            )
            self._hook(self.servicer)
            engine_pb2_grpc.add_DecodeServiceServicer_to_server(self.servicer, server)  # type: ignore[no-untyped-call]
            return
        from baton_prefill.servicer import PrefillServicer

        metrics = self.metrics

        def on_free(req_id: str, reason: str) -> None:
            engine.release_held([req_id])
            if reason == "expired":
                metrics.kv_lease_expired.inc()
                logger.warning("lease of request %s expired before its pull", req_id)
            metrics.kv_leases_active.set(leases.num_active)

        leases = LeaseTable(on_free, default_ttl_s=self.config.kv_lease_ms / 1000)
        self.leases = leases
        rows = _STAGING_REQUESTS * -(core.max_model_len // -core.config.block_size)
        self._registered = core.enable_kv_export(rows)  # the pool itself unless split
        self.source = KVTransferSource(
            self._registered,
            engine_id=self.engine_id,
            epoch=self.epoch,
            compat_hash=self.compat,
            leases=leases,
            backend=self.backend,
        )
        self.source.add_to_server(server)
        self.servicer = PrefillServicer(
            engine,
            leases,
            worker_id=self.worker_id,
            engine_id=self.engine_id,
            epoch=self.epoch,
            transfer_endpoint=self.address,
            compat_hash=self.compat,
            served_model_name=self.name,
            metrics_url=self.metrics_url,
        )
        self._hook(self.servicer)
        engine_pb2_grpc.add_PrefillServiceServicer_to_server(self.servicer, server)  # type: ignore[no-untyped-call]

    def _hook(self, servicer: WorkerInfoMixin) -> None:
        servicer.release_kv_memory = self.release_kv_memory
        servicer.restore_kv_memory = self.restore_kv_memory
        servicer.on_sleep_level = self.metrics.record_sleep_level
        servicer.profile_prefix = self.worker_id.replace(":", "-")

    def release_kv_memory(self) -> None:
        """Sleep mode: the KV transfer lets go of the engine's pool (when it registered the
        pool itself, not a staging or export area sleep keeps) before its memory is freed."""
        if self.sink is not None and self._registered is self._pool:
            self.sink.release_memory()
        if self.source is not None and self._registered is self._pool:
            self.source.release_memory()

    def restore_kv_memory(self) -> None:
        """Woken: the pool's memory is back at another address; registered again, a prefill
        worker's under a new epoch (its peers' handshakes are stale)."""
        if self._registered is not self._pool:
            return
        if self.sink is not None:
            self.sink.restore_memory(self._pool)
        if self.source is not None:
            self.epoch = max(self.epoch + 1, int(time.time() * 1000))
            self.source.restore_memory(self._pool, self.epoch)
            prefill: Any = self.servicer
            prefill.epoch = self.epoch  # (the KV handles it gives out)

    def start(self) -> None:
        if self.leases is not None:
            self._lease_task = asyncio.create_task(self.leases.run(0.05))

    def worker_info(self, core: EngineCore) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id,
            role="prefill" if self.config.role == "prefill" else "decode",
            grpc_address=self.address,
            transfer_endpoint=self.address if self.source is not None else "",
            engine_id=self.engine_id,
            epoch=self.epoch,
            transfer_metadata=self.source.metadata() if self.source is not None else b"",
            num_blocks=core.kv.pool.num_blocks,
            block_size=core.config.block_size,
            model=self.name,
        )

    async def close(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
            await asyncio.gather(self._lease_task, return_exceptions=True)
        if self.puller is not None:
            await self.puller.close()
        if self.sink is not None:
            await self.sink.close()
        if self.source is not None:
            self.source.close()


async def _serve(
    core: EngineCore,
    engine_thread: EngineThread,
    config: WorkerConfig,
    name: str,
    max_pending: int,
) -> int:
    loop = asyncio.get_running_loop()
    metrics = WorkerMetrics(
        name,
        metric_names=config.metric_names,
        max_model_len=core.max_model_len,
        cache_config=core.cache_config_info(),
        max_loras=core.config.max_loras if core.config.enable_lora else None,
    )
    try:
        httpd, _ = start_http_server(
            config.metrics_port, addr=config.host, registry=metrics.registry
        )
    except OSError as e:
        raise BatonError(f"cannot serve metrics on {config.host}:{config.metrics_port}: {e}") from e
    metrics_url = f"http://{url_host(config.host)}:{httpd.server_port}/metrics"

    health = health_aio.HealthServicer()
    background: set[asyncio.Task[None]] = set()  # keeps fire-and-forget tasks alive
    service_name = SERVICE_NAME if config.role == "decode" else PREFILL_SERVICE_NAME

    stop, force = asyncio.Event(), asyncio.Event()
    died = False

    def on_dead() -> None:
        # The engine cannot come back (a failed device, a tensor-parallel rank gone): its
        # requests have failed; the worker stops with status 1, for its supervisor (baton serve,
        # a container runtime) to restart it, as vLLM's server exits when its engine dies.
        nonlocal died
        died = True
        logger.error("the engine is dead; the worker stops")
        for service in ("", service_name):
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            task = loop.create_task(health.set(service, not_serving))
            background.add(task)
            task.add_done_callback(background.discard)
        stop.set()

    # Without SO_REUSEPORT off, a second worker on the same port would silently share it.
    # Requests may carry a prompt's embeddings (gRPC's default cap is 4 MiB).
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ]
    )
    try:
        port = server.add_insecure_port(grpc_address(config.host, config.port))
    except RuntimeError as e:
        httpd.shutdown()
        raise BatonError(f"cannot listen on {grpc_address(config.host, config.port)}: {e}") from e
    address = grpc_address(config.host, port)
    role = _Role(core, config, name, metrics, metrics_url, address)
    engine = EngineLoop(
        core,
        loop,
        max_pending=max_pending,
        metrics=metrics,
        log_stats_interval_s=config.log_stats_interval_s,
        on_dead=on_dead,
        on_kv_load=role.on_kv_load if config.role == "decode" else None,
        thread=engine_thread,
    )
    role.build(engine, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    engine.start()
    registration: WorkerRegistration | None = None
    try:
        await server.start()
        role.start()
        for service in ("", service_name):
            await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if config.kvstore_address:
            registration = _registration(config.kvstore_address, role, engine)
            registration.start()
        _set_process_title(f"baton {config.role} {address}")
        print(f"baton {config.role} ready on {address} (metrics {metrics_url})", flush=True)
        logger.info(
            "serving %s, at most %d requests in flight, KV transfer over %s",
            name,
            max_pending,
            role.backend,
        )
        await stop.wait()
        await _drain(role.servicer, health, config.shutdown_grace_s, force)
        if registration is not None:
            await registration.stop()
        await server.stop(_STOP_GRACE_S)
    finally:
        await role.close()
        engine.shutdown()
        httpd.shutdown()
        httpd.server_close()
    logger.info("%s worker stopped", config.role)
    return 1 if died else 0


def _registration(address: str, role: _Role, engine: EngineLoop) -> WorkerRegistration:
    core = engine.core

    def load() -> WorkerLoad:
        stats = engine.stats
        return WorkerLoad(
            num_running=stats.num_running,
            num_waiting=max(stats.num_waiting, engine.num_pending - stats.num_running),
            kv_cache_usage=stats.kv_cache_usage,
            max_num_seqs=core.config.max_num_seqs,
        )

    return WorkerRegistration(
        KVStoreClient(address),
        role.worker_info(core),
        load=load,
        take_events=engine.take_kv_events,
        snapshot=engine.cached_block_hashes,
    )


async def _drain(
    servicer: Any,
    health: health_aio.HealthServicer,
    grace_s: float,
    force: asyncio.Event,
) -> None:
    """Refuse new work, give in-flight requests ``grace_s`` (or until ``force``), abort the rest."""
    engine = servicer.engine
    servicer.draining = True
    await health.enter_graceful_shutdown()
    logger.info("shutting down: draining %d requests for up to %.1f s", engine.num_pending, grace_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while engine.num_pending and not force.is_set() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    num_aborted = engine.abort_all()
    if num_aborted:
        logger.warning("aborted %d requests still running at shutdown", num_aborted)
