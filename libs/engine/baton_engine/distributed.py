"""Tensor parallelism across processes: the group, its two collectives, the helper processes.

An engine with ``tensor_parallel_size`` N > 1 is N processes on one host. Rank 0 is the engine
(scheduler, outputs); ranks 1..N-1 are helpers started here, each holding its shard of the model
and of the KV cache (``models.llama.shard_config``) on its own device (``cuda:<rank>``, or the
CPU). Every rank builds its runner with the same calls in the same order (the collectives inside
match up), then each helper runs every step that rank 0 sends it (``TensorParallelHelpers.step``)
on its shard. The layers' row-parallel projections are summed with ``all_reduce``; rank 0's
sampled token ids are broadcast, so that every rank feeds the same tokens to the next step.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from baton_engine.profiler import StepProfiler

logger = logging.getLogger(__name__)

# A rank that died leaves the others blocked in a collective; they give up after this long.
_TIMEOUT = datetime.timedelta(seconds=120)
_START_TIMEOUT_S = 600.0
_TEARDOWN_TIMEOUT_S = 30.0
_group: Any = None


def device_for(device: str, rank: int, size: int) -> str:
    """The device of ``rank``: ``cuda:<rank>`` for ``cuda`` with several ranks."""
    if size > 1 and device == "cuda":
        return f"cuda:{rank}"
    return device


def init_group(rank: int, size: int, store: Any, device: str) -> None:
    """Join the tensor-parallel group (NCCL on GPUs, gloo on CPUs) through rank 0's ``store``."""
    global _group
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        # the ranks share the cores this process may run on
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=_TIMEOUT,
    )
    _group = dist.group.WORLD
    # The communicator is made on the first collective: here, not inside a CUDA graph capture.
    all_reduce(torch.zeros(1, device=device))


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns it."""
    dist.all_reduce(x, group=_group)
    return x


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place; returns it."""
    dist.broadcast(_moved(x), src=0, group=_group)
    return x


def gather(x: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's ``x`` (same shape everywhere), in rank order, on rank 0; None elsewhere."""
    if dist.get_rank(_group) != 0:
        dist.gather(_moved(x), dst=0, group=_group)
        return None
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(_group))]
    dist.gather(_moved(x), gather_list=[_moved(p) for p in parts], dst=0, group=_group)
    return parts


def _moved(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a collective moves it: an 8-bit float (an FP8 KV cache's blocks) as its bytes,
    which gloo does not take as floats; any other tensor as it is."""
    return x.view(torch.uint8) if x.is_floating_point() and x.element_size() == 1 else x


def all_min(value: int, device: str) -> int:
    """The smallest of the ranks' ``value``."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_group)
    return int(t.item())


def _joined_key(rank: int) -> str:
    return f"baton/tp/joined/{rank}"


@dataclass(frozen=True)
class KVBlocks:
    """Sent to the helpers before rank 0 broadcasts KV blocks pulled from a peer (of this
    shape and dtype) for the pool's ``block_ids``."""

    block_ids: list[int]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class LoRAAdapters:
    """Hold these adapters, ``(name, folder)``, and no others (rank 0's, before a step that
    may use them)."""

    held: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class GatherKV:
    """Sent to the helpers before rank 0 gathers each rank's heads of the pool's blocks
    ``block_ids`` (``EngineCore`` exporting a prefilled prompt's KV as whole blocks)."""

    block_ids: list[int]


@dataclass(frozen=True)
class Sleep:
    """Sleep mode: sleep at ``level`` (``ModelRunner.sleep``), or, with ``tags``, wake those
    parts (``ModelRunner.wake_up``: the graph captures inside have collectives), or with
    ``reload`` read the weights again (``ModelRunner.read_weights_again``)."""

    level: int = 0
    tags: tuple[str, ...] = ()
    reload: bool = False


@dataclass(frozen=True)
class Profile:
    """Start (with the traces' ``prefix``) or stop the rank's profiler (``--profiler-config``)."""

    start: bool
    prefix: str | None = None


def _leave_group(clean: bool) -> None:
    """Tear this rank's group down, as every rank does when the engine stops: ``destroy`` when
    they all do (``clean``), else (a rank is gone) NCCL's ``abort``. The runner's CUDA graphs
    must be gone first (``ModelRunner.release_graphs``): NCCL's teardown waits for the graphs
    that captured its collectives. Bounded all the same: a teardown that does not finish in
    ``_TEARDOWN_TIMEOUT_S`` is left behind in its thread, with a warning, rather than hang the
    process."""
    if not dist.is_initialized():
        return
    if clean or dist.get_backend() != "nccl":  # (gloo has no abort; its destroy does not wait)
        leave = dist.destroy_process_group
    else:
        leave = dist.distributed_c10d._abort_process_group
    thread = threading.Thread(target=leave, name="baton-tp-teardown", daemon=True)
    thread.start()
    thread.join(_TEARDOWN_TIMEOUT_S)
    if thread.is_alive():
        logger.warning(
            "the tensor-parallel group did not tear down within %.0f s; left behind",
            _TEARDOWN_TIMEOUT_S,
        )


def _helper_main(config: Any, rank: int, port: int, conn: Connection) -> None:
    """A helper rank: build the runner as rank 0 does, then run each step it is sent until
    ``None`` (or rank 0 is gone)."""
    from baton_engine.core.engine_core import build_runner

    logging.basicConfig(level=logging.WARNING)
    size = config.tensor_parallel_size
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, size, False, timeout=_TIMEOUT
    )
    store.set(_joined_key(rank), "1")  # rank 0 joins the group once every helper has come
    init_group(rank, size, store, device_for(config.device, rank, size))
    runner = build_runner(config, rank).runner
    profiling = config.profiler()
    profiler = StepProfiler(profiling, runner.device, rank) if profiling.profiler else None
    conn.send("ready")
    clean = False
    while True:
        try:
            so = conn.recv()
        except EOFError:  # rank 0 is gone
            break
        if so is None:
            clean = True
            break
        if isinstance(so, KVBlocks):  # rank 0 broadcasts the blocks; this rank keeps its heads
            blocks = torch.empty(so.shape, dtype=so.dtype, device=runner.device)
            broadcast(blocks)
            runner.load_kv_blocks(so.block_ids, blocks)
            continue
        if isinstance(so, GatherKV):  # this rank's heads of the blocks go to rank 0
            gather(runner.read_kv_blocks(so.block_ids))
            continue
        if isinstance(so, Sleep):
            if so.reload:
                runner.read_weights_again()
            elif so.tags:
                runner.wake_up(so.tags)
            else:
                runner.sleep(so.level)
            continue
        if isinstance(so, LoRAAdapters):  # its share of each, read from the same folders
            assert runner.lora is not None
            runner.lora.mirror(so.held)
            continue
        if isinstance(so, Profile):
            assert profiler is not None  # (rank 0 sends it only in the state it allows)
            if so.start:
                profiler.start(so.prefix)
            else:
                profiler.stop()
                all_reduce(torch.zeros(1, device=runner.device))  # (rank 0 waits for the trace)
            continue
        if profiler is not None and profiler.running:
            with profiler.step("engine_step"):
                runner.launch(so).result()
            continue
        runner.launch(so).result()
    runner.release_graphs()
    _leave_group(clean)


class TensorParallelHelpers:
    """Ranks 1..N-1 of an engine, started in the background; then rank 0 joins the group."""

    def __init__(self, config: Any) -> None:
        size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        # Rank 0 holds the rendezvous store, on a port of its choosing.
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", 0, size, True, timeout=_TIMEOUT, wait_for_workers=False
        )
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_helper_main,
                args=(config, rank, store.port, child),
                name=f"baton-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        # A helper that dies leaves rank 0's kernels waiting in a collective (NCCL cannot tell;
        # on GPUs they are often inside a CUDA graph, where no timeout applies): the watcher
        # aborts the group, which ends them, and check() fails the step that waited.
        self._left = False
        self._gone: int | None = None  # the rank the watcher saw exit
        self.on_gone: Callable[[], None] | None = None  # called by the watcher, if set
        self._woken, self._wake = mp.Pipe(duplex=False)
        self._watcher = threading.Thread(target=self._watch, name="baton-tp-watch", daemon=True)
        self._watcher.start()
        try:
            # Join the group only once every helper is in the store: a helper that dies
            # before (a bad device, out of memory, killed) fails the start-up now, where
            # the group's rendezvous would wait for it for _TIMEOUT.
            joined = [_joined_key(rank) for rank in range(1, size)]
            deadline = time.monotonic() + _START_TIMEOUT_S
            while not store.check(joined):
                self.check()
                if time.monotonic() > deadline:
                    raise RuntimeError("the tensor-parallel ranks did not start")
                time.sleep(0.02)
            init_group(0, size, store, device_for(config.device, 0, size))
        except BaseException:
            self.close(kill=True)
            raise

    def wait_ready(self) -> None:
        """After rank 0 built its runner: every helper has built its own."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        for rank, conn in enumerate(self._conns, start=1):
            while not conn.poll(0.05):
                self.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start")
            try:
                message = conn.recv()
            except EOFError:  # it died, closing its end of the pipe
                self.check(grace_s=1.0)
                message = None
            if message != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} did not start")

    def step(self, so: Any) -> None:
        """Have every helper run ``so`` (before rank 0 launches it)."""
        self._send(so)

    def send_kv_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Have every helper take its heads of ``blocks`` (before rank 0 broadcasts them)."""
        self._send(KVBlocks(block_ids, tuple(blocks.shape), blocks.dtype))

    def send_gather_kv(self, block_ids: list[int]) -> None:
        """Have every helper send rank 0 its heads of the pool's ``block_ids`` (before rank 0
        gathers them)."""
        self._send(GatherKV(block_ids))

    def hold_adapters(self, held: list[tuple[str, str]]) -> None:
        """Have every helper hold exactly the LoRA adapters ``held`` (``(name, folder)``,
        rank 0's ``LoRAManager.held``) before the steps sent after."""
        self._send(LoRAAdapters(tuple(held)))

    def sleep(self, level: int) -> None:
        """Have every helper sleep at ``level`` (as rank 0 does next)."""
        self._send(Sleep(level=level))

    def wake_up(self, tags: Sequence[str]) -> None:
        """Have every helper wake ``tags`` (as rank 0 does next)."""
        self._send(Sleep(tags=tuple(tags)))

    def reload_weights(self) -> None:
        """Have every helper read its shard of the weights again (as rank 0 does next)."""
        self._send(Sleep(reload=True))

    def profile(self, start: bool, prefix: str | None = None) -> None:
        """Have every helper start (or stop) its profiler, as rank 0 does; after a stop each
        joins an all-reduce once its trace is written (rank 0's wait)."""
        self._send(Profile(start, prefix))

    def _send(self, message: Any) -> None:
        self.check()
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError) as e:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone") from e

    def check(self, grace_s: float = 0.0) -> None:
        """Raise if a helper has exited, waiting up to ``grace_s`` for one to be seen gone
        (a collective can fail a moment before its peer's exit is reaped)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, proc in enumerate(self._procs, start=1):
                if rank == self._gone or proc.exitcode is not None:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} is gone (exit code {proc.exitcode})"
                    )
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def _watch(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs, start=1)}
        ready = mp_connection.wait([*sentinels, self._woken])
        gone = sorted(sentinels[s] for s in ready if s in sentinels)
        if not gone:  # close() woke us: the helpers are being stopped
            return
        # Its sentinel closes as it exits, a moment before it can be reaped (exitcode).
        self._procs[gone[0] - 1].join(1.0)
        self._gone = gone[0]
        logger.error("tensor-parallel rank %d exited; the engine cannot step any more", gone[0])
        if self.on_gone is not None:
            self.on_gone()
        if dist.is_initialized() and dist.get_backend() == "nccl":  # (gloo's peers notice)
            self._left = True
            _leave_group(clean=False)

    def close(self, kill: bool = False) -> None:
        """Stop the helpers: each leaves the group as it stops, and rank 0 (its graphs
        released) leaves with them; with ``kill`` (the start-up failed), at once."""
        self._wake.send(None)  # (the watcher may be gone: the pipe's reader lives on)
        self._watcher.join()
        self._wake.close()
        self._woken.close()
        if kill:
            for proc in self._procs:
                proc.kill()
        clean = not kill and all(proc.is_alive() for proc in self._procs)
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                clean = False
            conn.close()
        if not self._left:
            _leave_group(clean)
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._conns, self._procs = [], []
