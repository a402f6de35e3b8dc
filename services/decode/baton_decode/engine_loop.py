"""Runs EngineCore's busy loop in its own thread and bridges it to asyncio.

::

    asyncio loop (gRPC handlers)                 engine thread
    ----------------------------                 -------------
    add_request / abort ── SimpleQueue ──────►  apply commands between steps
                                                 step()  (blocks on the queue when idle)
    RequestStream.queue ◄── call_soon_threadsafe ── outputs of the step, or errors

The thread owns the EngineCore, and builds it (``EngineThread``): no other thread calls into it
except for the read-only ``validate_request``, and no other thread of a worker runs torch work.
A step therefore never waits on request handling and a slow step never blocks the event loop.
``_streams`` (req_id -> stream of every accepted, unfinished request) is owned by the asyncio
loop; the thread's own view of what the engine holds is ``_live``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from baton_decode.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineStepError,
    WorkerFullError,
)
from baton_decode.metrics import StatsLogger, WorkerMetrics
from baton_engine.core.engine_core import EngineCore, EngineStats
from baton_engine.core.outputs import EngineCoreOutput, KVLoad
from baton_engine.errors import BatonError, EngineSleepingError, InvalidRequestError
from baton_engine.lora import LoRARequest
from baton_engine.pooling_params import PoolingParams
from baton_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A step that fails this many times in a row (each time with every request failed and freed)
# points at the engine, not at a request: stop serving rather than fail every request forever.
_MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass(frozen=True)
class _Add:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    prefill_only: bool = False
    remote_kv: object | None = None
    first_token_id: int | None = None
    priority: int = 0
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    prompt_embeds: torch.Tensor | None = None


@dataclass(frozen=True)
class _Abort:
    req_ids: list[str]


@dataclass(frozen=True)
class _ReleaseHeld:
    req_ids: list[str]


@dataclass(frozen=True)
class _LoadDone:
    req_id: str
    ok: bool
    staged: StagedKV | None = None


@dataclass(frozen=True)
class StagedKV:
    """A pull that landed in a staging buffer, not in the engine's pool: whole-head blocks in
    rows ``slots`` of ``pool``, for the engine's ``block_ids``. The engine thread loads them
    (``EngineCore.load_kv_blocks``: each tensor-parallel rank takes its heads), then calls
    ``release`` (the rows may be reused)."""

    block_ids: list[int]
    pool: Any  # torch.Tensor
    slots: list[int]
    release: Callable[[], None]


@dataclass(frozen=True)
class _Call:
    """Run ``fn`` on the engine thread between steps; ``done`` gets its result or error."""

    fn: Callable[[EngineCore], object]
    done: Callable[[object, BaseException | None], None]


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _Wake:
    """Nothing to do: the loop only checks that its engine is alive."""


_Command = _Add | _Abort | _ReleaseHeld | _LoadDone | _Call | _Stop | _Wake


class EngineThread:
    """The one thread of a worker process that does torch work: it builds the engine core,
    then runs the loop handed to it (``run``).

    Building on the thread that will step matters on CPUs: libgomp keeps a thread pool per
    thread that ever ran a parallel region, and once a process holds more pool threads than it
    has cores, every pool's threads sleep at each barrier after ~100 spins instead of ~300,000.
    A decode step of 16 requests on 2 cores took 47 ms instead of 30 with the model loaded on
    the main thread and stepped on another (``benchmarks/RESULTS.md``, fifth session).
    """

    def __init__(self, build: Callable[[], EngineCore]) -> None:
        self._build = build
        self._core: EngineCore | None = None
        self._error: BaseException | None = None
        self._built = threading.Event()
        self._target: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self._core = self._build()
        except BaseException as e:  # re-raised by core() on the caller's thread
            self._error = e
            return
        finally:
            self._built.set()
        target = self._target.get()
        if target is not None:
            target()

    def core(self) -> EngineCore:
        """Wait for the build; return the core or raise what the build raised."""
        self._built.wait()
        if self._error is not None:
            raise self._error
        assert self._core is not None
        return self._core

    def run(self, target: Callable[[], None]) -> None:
        """Run ``target`` on the thread (once, after the build)."""
        self._target.put(target)

    def cancel(self) -> None:
        """End the thread without running anything (no effect once ``run`` was called)."""
        self._target.put(None)


@dataclass
class RequestStream:
    """The asyncio side of one request: its outputs in step order, ending with a finished output
    (finish_reason set, possibly "abort") or an error. Read with ``next_batch`` only."""

    req_id: str
    num_prompt_tokens: int
    arrival_time: float  # time.monotonic() when accepted
    queue: asyncio.Queue[EngineCoreOutput | BatonError] = field(default_factory=asyncio.Queue)
    last_token_time: float | None = None  # None until the first token
    first_token_time: float | None = None
    scheduled_time: float | None = None  # when the engine first scheduled it
    max_tokens: int | None = None  # as the engine resolves it (None: an embedding)
    num_generated: int = 0  # tokens delivered so far
    # Called (on the loop) after each item is queued: a GenerateStream call drains the streams
    # that have news once per step instead of awaiting each.
    on_put: Callable[[RequestStream], None] | None = None

    def put(self, item: EngineCoreOutput | BatonError) -> None:
        self.queue.put_nowait(item)
        if self.on_put is not None:
            self.on_put(self)

    def take_nowait(self) -> tuple[list[EngineCoreOutput], BatonError | None]:
        """Every output delivered so far, and the error that ended the request if it came."""
        outputs: list[EngineCoreOutput] = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, BatonError):
                return outputs, item
            outputs.append(item)
        return outputs, None

    async def next_batch(self) -> list[EngineCoreOutput]:
        """Wait for at least one output, then take every output already delivered.

        Raises the error that ended the request once the outputs before it were returned.
        """
        outputs: list[EngineCoreOutput] = []
        item = await self.queue.get()
        while True:
            if isinstance(item, BatonError):
                if not outputs:
                    raise item
                self.queue.put_nowait(item)  # raised on the next call, after these outputs
                return outputs
            outputs.append(item)
            if self.queue.empty():
                return outputs
            item = self.queue.get_nowait()


class EngineLoop:
    """Owns the engine thread. Public methods must be called on ``loop``'s thread.

    At most ``max_pending`` requests are held at once (accepted and not finished: the engine's
    running and waiting ones plus any handed over during the current step); ``on_dead`` is called
    on the loop once the engine is dead (to report unhealthy).
    """

    def __init__(
        self,
        core: EngineCore,
        loop: asyncio.AbstractEventLoop,
        *,
        max_pending: int,
        metrics: WorkerMetrics | None = None,
        log_stats_interval_s: float = 5.0,
        on_dead: Callable[[], None] | None = None,
        on_kv_load: Callable[[KVLoad], None] | None = None,
        thread: EngineThread | None = None,
    ) -> None:
        """``thread``: the thread that built ``core``, to step it on (a new thread if None)."""
        self.core = core
        self._on_kv_load = on_kv_load  # called on the loop for each pull to start
        self._kv_events: list[tuple[str, bytes]] = []  # (kind, hash) since take; loop thread
        self._loop = loop
        self.max_pending = max_pending
        self._metrics = metrics
        self._on_dead = on_dead
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # req_id -> stream; loop thread only
        self._live: set[str] = set()  # req_ids inside the engine; engine thread only
        self._stats: EngineStats = core.stats()  # replaced whole by the engine thread
        self._stats_logger = StatsLogger(self._stats, log_stats_interval_s)
        self._dead: EngineDeadError | None = None
        # Why new requests are refused for now (sleep mode: the worker is going to sleep)
        self.closing: str | None = None
        self._num_step_failures = 0  # consecutive; engine thread only
        self._engine_thread = thread
        if thread is not None:
            self._thread = thread.thread
        else:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # --- asyncio side --------------------------------------------------------------------------

    def start(self) -> None:
        # A tensor-parallel rank that exits ends the engine now, not at the next request.
        self.core.on_rank_gone(lambda: self._commands.put(_Wake()))
        if self._engine_thread is not None:
            self._engine_thread.run(self._run)
        else:
            self._thread.start()

    @property
    def stats(self) -> EngineStats:
        """The engine's counters after its latest iteration."""
        return self._stats

    @property
    def num_pending(self) -> int:
        """Requests accepted and not finished, including those not yet handed to the engine."""
        return len(self._streams)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's structured output (if any) on a worker thread, before
        :meth:`add_request`, which then finds it in XGrammar's cache.

        A compile can take a while (the first also loads the tokenizer, ~1 s); on the asyncio
        loop it would hold up every other call meanwhile, the gateway's load polls among them,
        and the gateway would take the worker for dead. Raises ``InvalidRequestError`` for one
        that does not compile.
        """
        so = params.structured_outputs
        if so is not None:
            await asyncio.to_thread(self.core.structured.grammar, so)

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | PoolingParams,
        *,
        prefill_only: bool = False,
        remote_kv: object | None = None,
        first_token_id: int | None = None,
        priority: int = 0,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
    ) -> RequestStream:
        """Validate and queue a request; its outputs arrive on the returned stream (an
        embedding request's, ``PoolingParams``: one output, with ``pooled``).

        ``lora_name``: one of the engine's ``lora_modules`` (None or "": the base model);
        ``cache_salt``: the request shares prefix-cache blocks only with requests of the same.
        ``prompt_embeds``: the prompt as input embeddings, ``prompt_token_ids`` their rows' ids
        (both from ``EngineCore.embeds_prompt``).

        Raises, before anything is queued: ``InvalidRequestError`` (``DuplicateRequestError``
        for an id in flight), ``EngineSleepingError`` (sleep mode), then ``WorkerFullError``, or
        ``EngineDeadError``. Bad input is reported as such even when the worker is full:
        retrying it elsewhere cannot help.
        """
        if self._dead is not None:
            raise self._dead
        if req_id in self._streams:
            raise DuplicateRequestError(f"request id {req_id!r} is already in flight")
        self.core.check_awake()  # (sleep mode; a read of a set another thread changes)
        if self.closing is not None:
            raise EngineSleepingError(self.closing)
        # reads only immutable config (and compiles a structured output's grammar, which
        # XGrammar caches for the loop's add_request; servers call compile_grammar first)
        # (an adapter served by name is read at start-up: validating one reads no file)
        lora_request = self.core.lora_request(lora_name)
        self.core.validate_request(prompt_token_ids, params, priority, lora_request, prompt_embeds)
        if len(self._streams) >= self.max_pending:
            raise WorkerFullError(
                f"the worker is at capacity ({len(self._streams)} requests in flight)"
            )
        if remote_kv is not None and self._on_kv_load is None:
            raise InvalidRequestError("this worker cannot pull remote KV")
        stream = RequestStream(req_id, len(prompt_token_ids), time.monotonic())
        if isinstance(params, SamplingParams):
            room = self.core.max_model_len - len(prompt_token_ids)
            stream.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._streams[req_id] = stream
        self._commands.put(
            _Add(
                req_id,
                list(prompt_token_ids),
                params,
                prefill_only=prefill_only,
                remote_kv=remote_kv,
                first_token_id=first_token_id,
                priority=priority,
                lora_request=lora_request,
                cache_salt=cache_salt,
                prompt_embeds=prompt_embeds,
            )
        )
        return stream

    def take_kv_events(self) -> list[tuple[str, bytes]]:
        """Prefix-cache changes (``"stored"``/``"removed"``, block hash) in the order they
        happened, since the last call (the engine must have ``enable_kv_events``)."""
        events, self._kv_events = self._kv_events, []
        return events

    def cached_block_hashes(self) -> list[bytes]:
        """Every hash the engine's prefix cache holds now."""
        return self.core.cached_block_hashes()

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """``fn(core)`` run on the engine thread between steps (what changes the engine's
        state outside requests): its result, or the exception it raised."""
        if self._dead is not None:
            raise self._dead
        future: asyncio.Future[T] = self._loop.create_future()

        def settle(result: object, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        self._commands.put(_Call(fn, lambda r, e: self._post(settle, r, e)))
        return await future

    def release_held(self, req_ids: Sequence[str]) -> None:
        """Free the prompt blocks prefill-only requests left held (unknown ids are ignored)."""
        self._commands.put(_ReleaseHeld(list(req_ids)))

    def finish_kv_load(self, req_id: str, ok: bool, staged: StagedKV | None = None) -> None:
        """Report a pull handed out through ``on_kv_load``: the request decodes on success and
        recomputes its prompt otherwise. ``staged``: where the pull left the KV, when not in
        the engine's pool (released in any case)."""
        self._commands.put(_LoadDone(req_id, ok, staged))

    def abort(self, req_ids: Sequence[str]) -> int:
        """End these requests now with finish reason "abort" and free them in the engine.

        Unknown or finished ids are ignored; returns how many were in flight. Idempotent.
        """
        aborted = [req_id for req_id in req_ids if req_id in self._streams]
        for req_id in aborted:
            stream = self._streams.pop(req_id)
            stream.put(EngineCoreOutput(req_id, [], finish_reason="abort"))
            if self._metrics is not None:
                self._metrics.record_finished("abort")
        if aborted:
            self._commands.put(_Abort(aborted))
        return len(aborted)

    def fail(self, req_id: str, error: BatonError) -> None:
        """End one request with ``error`` (its stream raises it) and drop it from the engine."""
        stream = self._streams.pop(req_id, None)
        if stream is None:
            return
        stream.put(error)
        if self._metrics is not None:
            self._metrics.record_finished("error")
        self._commands.put(_Abort([req_id]))

    def request_ids(self) -> list[str]:
        """The requests accepted and not finished."""
        return list(self._streams)

    def abort_all(self) -> int:
        return self.abort(list(self._streams))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after its current step, then the engine's tensor-parallel ranks
        (if any). Call ``abort_all`` first to end streams."""
        self._commands.put(_Stop())
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # (else a step is stuck: the process exit ends it)
            self.core.shutdown()

    def _deliver(
        self,
        outputs: list[EngineCoreOutput],
        errors: list[tuple[str, BatonError]],
        first_scheduled: list[tuple[str, float]],
    ) -> None:
        """Runs on the loop: note when requests were first scheduled, then route a step's
        outputs and errors to their streams."""
        now = time.monotonic()
        metrics = self._metrics
        streams = self._streams
        for req_id, when in first_scheduled:
            stream = streams.get(req_id)
            if stream is not None:
                stream.scheduled_time = when
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is None:  # aborted while the step ran
                continue
            stream.num_generated += len(out.new_token_ids)
            if metrics is not None and out.new_token_ids:
                if stream.last_token_time is None:
                    metrics.time_to_first_token.observe(now - stream.arrival_time)
                    stream.first_token_time = now
                else:
                    metrics.record_inter_token(now - stream.last_token_time)
                stream.last_token_time = now
            stream.put(out)
            if out.finish_reason is not None:
                del self._streams[out.req_id]
                if metrics is not None:
                    metrics.e2e_request_latency.observe(now - stream.arrival_time)
                    metrics.record_finished(
                        out.finish_reason,
                        stream.num_prompt_tokens,
                        stream.num_generated,
                        stream.max_tokens,
                    )
                    if stream.scheduled_time is not None:
                        first = stream.first_token_time
                        metrics.record_request_times(
                            stream.arrival_time,
                            stream.scheduled_time,
                            now if first is None else first,
                            now,
                            stream.num_generated,
                        )
        for req_id, error in errors:
            stream = self._streams.pop(req_id, None)
            if stream is not None:
                stream.put(error)

    def _start_kv_loads(self, loads: list[KVLoad]) -> None:
        """Runs on the loop: hand each new pull to the worker."""
        assert self._on_kv_load is not None
        for load in loads:
            self._on_kv_load(load)

    def _fail_all(self, error: EngineDeadError) -> None:
        """Runs on the loop once the engine is dead."""
        self._dead = error
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)
        if self._on_dead is not None:
            self._on_dead()

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        # The loop may close under us during shutdown: then there is nobody left to tell.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback, *args)

    # --- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                commands = self._take_commands()
                if any(isinstance(c, _Stop) for c in commands):
                    return
                self.core.check_alive()
                errors: list[tuple[str, BatonError]] = []
                for command in commands:
                    self._apply(command, errors)
                if commands:
                    self._publish_stats()
                was_busy = self.core.has_schedulable_requests()
                outputs = self._step(errors) if was_busy else []
                scheduled = self.core.first_scheduled if was_busy else []
                if outputs or errors or scheduled:
                    self._post(self._deliver, outputs, errors, scheduled)
                loads = self.core.take_kv_loads()
                if loads:
                    self._post(self._start_kv_loads, loads)
                kv_events = self.core.take_kv_events()
                if kv_events:
                    pairs = [(e.kind, e.hash_value) for e in kv_events]
                    self._post(self._kv_events.extend, pairs)
                if (was_busy or commands) and self._is_idle():
                    # Idle is when nothing can race it. Large pools get the check of the blocks
                    # in use only: a full walk holds the GIL while RPCs and NIXL polls wait.
                    self.core.check_invariants(full=None)
        except BaseException as e:
            logger.exception("engine loop died; failing every request")
            self._post(self._fail_all, EngineDeadError(f"the engine failed: {e!r}"))

    def _take_commands(self) -> list[_Command]:
        """All queued commands; when the engine has no work, sleep until one arrives (or until
        the stats logger's window is due, so the last busy window still gets its line)."""
        commands: list[_Command] = []
        if not self.core.has_schedulable_requests():
            while not commands:
                timeout = self._stats_logger.next_due(time.monotonic())
                try:
                    commands.append(self._commands.get(timeout=timeout))
                except queue.Empty:
                    self._stats_logger.maybe_log(self._stats, time.monotonic())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Command, errors: list[tuple[str, BatonError]]) -> None:
        if isinstance(command, _Add):
            try:
                self.core.add_request(
                    command.req_id,
                    command.prompt_token_ids,
                    command.params,
                    prefill_only=command.prefill_only,
                    remote_kv=command.remote_kv,
                    first_token_id=command.first_token_id,
                    priority=command.priority,
                    lora_request=command.lora_request,
                    cache_salt=command.cache_salt,
                    prompt_embeds=command.prompt_embeds,
                )
            except EngineSleepingError as e:  # (it fell asleep since: no fault of the engine)
                errors.append((command.req_id, e))
            except Exception as e:  # validated on the loop already, so this is not bad input
                logger.exception("adding request %s failed", command.req_id)
                error = e if isinstance(e, BatonError) else EngineStepError(f"{e!r}")
                errors.append((command.req_id, error))
            else:
                self._live.add(command.req_id)
        elif isinstance(command, _Abort):
            self.core.abort_requests(command.req_ids)
            self._live.difference_update(command.req_ids)
            # A prefill-only request may have finished (blocks held) in the step before the
            # abort arrived: nobody will take its blocks now.
            for req_id in command.req_ids:
                self.core.release_held(req_id)
        elif isinstance(command, _ReleaseHeld):
            for req_id in command.req_ids:
                self.core.release_held(req_id)
        elif isinstance(command, _Call):
            try:
                result = command.fn(self.core)
            except Exception as e:  # the caller's to report
                command.done(None, e)
            else:
                command.done(result, None)
        elif isinstance(command, _LoadDone):
            ok, staged = command.ok, command.staged
            if staged is not None:
                try:
                    if ok:
                        self.core.load_kv_blocks(staged.block_ids, staged.pool[staged.slots])
                except Exception:
                    logger.exception("request %s: loading its pulled KV failed", command.req_id)
                    ok = False
                finally:
                    staged.release()
            self.core.finish_kv_load(command.req_id, ok)

    def _is_idle(self) -> bool:
        core = self.core
        return not core.has_unfinished_requests() and not core.scheduler.num_loading

    def _step(self, errors: list[tuple[str, BatonError]]) -> list[EngineCoreOutput]:
        try:
            outputs = self.core.step()
        except Exception as e:
            # The scheduler advanced every scheduled request before the runner failed, so their
            # state is suspect; failing (and freeing) all of them keeps the engine consistent.
            self._num_step_failures += 1
            failed = sorted(self._live)
            logger.exception("engine step failed; failing %d requests", len(failed))
            self.core.abort_requests(failed)
            self._live.clear()
            self.core.check_invariants()
            error = EngineStepError(f"the engine step failed: {e!r}")
            errors.extend((req_id, error) for req_id in failed)
            self._publish_stats()
            if self._num_step_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            return []
        self._num_step_failures = 0
        if self._metrics is not None:
            self._metrics.record_step(*self.core.last_step_tokens)
        for out in outputs:
            if out.finish_reason is not None:
                self._live.discard(out.req_id)
        # Counters first: a client that sees its last token then scrapes finds them updated.
        self._publish_stats()
        return outputs

    def _publish_stats(self) -> None:
        stats = self.core.stats()
        self._stats = stats
        metrics = self._metrics
        if metrics is not None:
            metrics.record_stats(stats)
            if metrics.exports_lora_info:
                metrics.record_lora_adapters(*self.core.lora_adapters())
        self._stats_logger.maybe_log(stats, time.monotonic())
