"""The decode worker's gRPC server: ``DecodeService`` plus ``grpc.health.v1``.

Capacity: a worker holds at most ``max_pending`` requests (accepted, not finished: engine
running + waiting, plus any handed over during the current step); one more is answered
RESOURCE_EXHAUSTED so the gateway can route it elsewhere instead of queueing it here. The
default, 4 x ``max_num_seqs``, keeps enough queued to refill the batch as requests finish while
bounding how long a request can sit in the queue.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING and new ``Generate`` calls get
UNAVAILABLE; in-flight requests get ``shutdown_grace_s`` to finish (a second signal cuts that
short); the rest end with finish reason ABORT; then the server stops and ``serve`` returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from baton.v1 import engine_pb2, engine_pb2_grpc
from baton_decode import codec
from baton_decode.engine_loop import EngineLoop
from baton_decode.errors import (
    DuplicateRequestError,
    EngineDeadError,
    UnsupportedRequestError,
    WorkerFullError,
)
from baton_decode.metrics import WorkerMetrics
from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.errors import BatonError, InvalidRequestError
from baton_engine.model_files import served_model_name

logger = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
_STOP_GRACE_S = 1.0  # for the last (ABORT) messages to leave once every request has ended


@dataclass(frozen=True)
class WorkerConfig:
    """The worker's own knobs (the engine's are in ``EngineConfig``)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (printed in the ready line)
    metrics_port: int = 0  # 0: any free port (reported by GetModelInfo.metrics_url)
    served_model_name: str | None = None  # None: the model argument, or the default model's name
    max_pending: int | None = None  # None: 4 * max_num_seqs
    shutdown_grace_s: float = 5.0
    log_stats_interval_s: float = 5.0


def _status_code(error: BatonError) -> grpc.StatusCode:
    if isinstance(error, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, WorkerFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, UnsupportedRequestError):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(error, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class DecodeServicer(engine_pb2_grpc.DecodeServiceServicer):
    """``DecodeService`` over one ``EngineLoop``; every method runs on the asyncio loop."""

    def __init__(self, engine: EngineLoop, *, served_model_name: str, metrics_url: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.metrics_url = metrics_url
        self.draining = False

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """Stream the request's tokens; each message carries every token sampled since the
        previous one. The call ending early for any reason (client cancel, deadline, error)
        aborts the request in the engine, which frees its blocks."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
            return
        try:
            inp = codec.generate_input_from_proto(request)
            stream = self.engine.add_request(inp.req_id, inp.prompt_token_ids, inp.params)
        except BatonError as e:
            await context.abort(_status_code(e), str(e))
            return
        finished = False
        try:
            while not finished:
                try:
                    outputs = await stream.next_batch()
                except BatonError as e:
                    finished = True  # the engine already dropped it
                    await context.abort(_status_code(e), str(e))
                    return
                finished = outputs[-1].finish_reason is not None
                yield codec.generate_response_to_proto(outputs, stream.num_prompt_tokens)
        finally:
            if not finished:
                self.engine.abort([stream.req_id])

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> engine_pb2.AbortResponse:
        """End the named requests (their streams get a last message with finish reason ABORT);
        unknown ids are ignored."""
        return engine_pb2.AbortResponse(num_aborted=self.engine.abort(list(request.req_ids)))

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


def _grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _url_host(host: str) -> str:
    """A host a client can dial: wildcard binds are reported under the machine's name."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _set_process_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:  # optional: only makes `ps` output nicer
        return
    setproctitle.setproctitle(title)


def serve(engine_config: EngineConfig, config: WorkerConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, and return the exit status (0).

    Prints ``baton decode ready on HOST:PORT (metrics URL)`` on stdout once it serves; launchers
    wait for that line. Raises ``BatonError`` if the model cannot be loaded or the port bound.
    """
    core = EngineCore(engine_config)  # before the event loop: loading blocks for seconds
    max_pending = config.max_pending or 4 * engine_config.max_num_seqs
    name = config.served_model_name or served_model_name(engine_config.model)
    return asyncio.run(_serve(core, config, name, max_pending))


async def _serve(core: EngineCore, config: WorkerConfig, name: str, max_pending: int) -> int:
    loop = asyncio.get_running_loop()
    metrics = WorkerMetrics(name)
    try:
        httpd, _ = start_http_server(
            config.metrics_port, addr=config.host, registry=metrics.registry
        )
    except OSError as e:
        raise BatonError(f"cannot serve metrics on {config.host}:{config.metrics_port}: {e}") from e
    metrics_url = f"http://{_url_host(config.host)}:{httpd.server_port}/metrics"

    health = health_aio.HealthServicer()
    background: set[asyncio.Task[None]] = set()  # keeps fire-and-forget tasks alive

    def on_dead() -> None:
        for service in ("", SERVICE_NAME):
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            task = loop.create_task(health.set(service, not_serving))
            background.add(task)
            task.add_done_callback(background.discard)

    engine = EngineLoop(
        core,
        loop,
        max_pending=max_pending,
        metrics=metrics,
        log_stats_interval_s=config.log_stats_interval_s,
        on_dead=on_dead,
    )
    servicer = DecodeServicer(engine, served_model_name=name, metrics_url=metrics_url)
    # Without SO_REUSEPORT off, a second worker on the same port would silently share it.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    # The generated *_pb2_grpc module is untyped.
    engine_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    try:
        port = server.add_insecure_port(_grpc_address(config.host, config.port))
    except RuntimeError as e:
        httpd.shutdown()
        raise BatonError(f"cannot listen on {_grpc_address(config.host, config.port)}: {e}") from e

    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    engine.start()
    try:
        await server.start()
        for service in ("", SERVICE_NAME):
            await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        _set_process_title(f"baton decode {_grpc_address(config.host, port)}")
        print(
            f"baton decode ready on {_grpc_address(config.host, port)} (metrics {metrics_url})",
            flush=True,
        )
        logger.info("serving %s, at most %d requests in flight", name, max_pending)
        await stop.wait()
        await _drain(servicer, health, config.shutdown_grace_s, force)
        await server.stop(_STOP_GRACE_S)
    finally:
        engine.shutdown()
        httpd.shutdown()
        httpd.server_close()
    logger.info("decode worker stopped")
    return 0


async def _drain(
    servicer: DecodeServicer,
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
