"""The decode worker's side of a remote prefill: pull the blocks a request lacks, then let it run.

For each ``KVLoad`` the engine hands out (the prompt's blocks not found in the local prefix
cache, already allocated), one task on the asyncio loop:

1. checks the handle: same compatibility hash as this worker (``Generate`` has already checked
   that its block hashes are the ones of this prompt, so KV of other tokens is never used);
2. pulls the blocks through ``baton_kvtransfer`` (which handshakes once per peer, keeps the
   lease alive while the pull is queued, and releases it afterwards, failing if it had expired),
   or only releases the lease when every block was cached here;
3. reports to the engine: on success the request decodes from its second token; on failure,
   under policy ``recompute`` (the default) it computes the prompt itself, under ``fail`` it ends
   with an error. Nothing ever decodes from KV whose lease was not held for the whole pull.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton import tracing
from baton_decode.engine_loop import EngineLoop, StagedKV
from baton_decode.metrics import WorkerMetrics
from baton_engine.core.outputs import KVLoad
from baton_engine.errors import BatonError, InvalidRequestError
from baton_engine.kv_cache.hashing import hash_request_tokens, prefix_root
from baton_kvtransfer.errors import KVTransferError
from baton_kvtransfer.handle import KVHandle
from baton_kvtransfer.sink import KVTransferSink

logger = logging.getLogger(__name__)


class KVLoadFailedError(BatonError):
    """The prompt's KV could not be pulled and the policy is ``fail``."""


@dataclass(frozen=True)
class RemoteKV:
    """What a remote-prefill request carries into the engine (opaque there): where its prompt's
    KV lives, and the trace its pull belongs to."""

    handle: KVHandle
    trace_parent: tracing.Context | None = None


class StagingArea:
    """Whole-head KV blocks that pulls land in first, for a decode worker whose engine is split
    across tensor-parallel ranks (its pool holds rank 0's heads only): the engine thread then
    gives each rank its heads (``StagedKV``) and the rows are free again. Use on one loop."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        self._free = list(range(pool.shape[0]))
        self._freed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def has_room(self, n: int) -> bool:
        return len(self._free) >= n

    async def acquire(self, n: int) -> list[int]:
        """``n`` rows, once that many are free."""
        if n > self.pool.shape[0]:
            raise KVLoadFailedError(
                f"the prompt's {n} blocks exceed the {self.pool.shape[0]} of the staging area"
            )
        self._loop = asyncio.get_running_loop()
        while len(self._free) < n:
            self._freed.clear()
            await self._freed.wait()
        rows, self._free = self._free[:n], self._free[n:]
        return rows

    def release(self, rows: list[int]) -> None:
        """On the loop."""
        self._free += rows
        self._freed.set()

    def releaser(self, rows: list[int]) -> Callable[[], None]:
        """A function any thread may call (once) to give ``rows`` back."""
        loop = self._loop
        assert loop is not None

        def release() -> None:
            loop.call_soon_threadsafe(self.release, rows)

        return release


class KVPuller:
    def __init__(
        self,
        engine: EngineLoop,
        sink: KVTransferSink,
        *,
        compat_hash: bytes,
        block_size: int,
        failure_policy: str = "recompute",
        metrics: WorkerMetrics | None = None,
        staging: StagingArea | None = None,
    ) -> None:
        """``staging``: pull into it (it is the ``sink``'s pool) rather than into the engine's
        pool, whose blocks are then loaded by the engine thread."""
        if failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv load failure policy must be recompute or fail: {failure_policy}")
        self.engine = engine
        self.sink = sink
        self.compat_hash = compat_hash
        self.block_size = block_size
        self.failure_policy = failure_policy
        self.metrics = metrics
        self.staging = staging
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_pulled_blocks = 0
        self.num_failures = 0

    def start(self, load: KVLoad) -> None:
        """Called on the loop by the engine loop for each new load."""
        task = asyncio.get_running_loop().create_task(self._run(load), name=f"pull-{load.req_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, load: KVLoad) -> None:
        remote = load.remote
        assert isinstance(remote, RemoteKV)
        handle = remote.handle
        span = tracing.start_span(
            "kv_transfer",
            remote.trace_parent,
            attributes={
                "baton.req_id": load.req_id,
                "baton.peer": handle.transfer_endpoint,
                "baton.blocks_cached_locally": load.first_block,
                "baton.blocks_to_pull": len(load.local_block_ids),
            },
        )
        ok = False
        staged: StagedKV | None = None
        try:
            staged = await self._pull(load, handle, span)
            ok = True
        except (KVTransferError, BatonError) as e:
            span.set_attribute("baton.error", str(e))
            self.num_failures += 1
            if self.metrics is not None:
                self.metrics.kv_transfer_failures.inc()
            logger.warning(
                "request %s: pulling KV from %s failed (%s); %s",
                load.req_id,
                handle.transfer_endpoint,
                e,
                "recomputing the prompt" if self.failure_policy == "recompute" else "failing it",
            )
            if self.failure_policy == "fail":
                self.engine.fail(load.req_id, KVLoadFailedError(f"KV transfer failed: {e}"))
        except Exception:
            self.num_failures += 1
            logger.exception("request %s: pulling KV failed unexpectedly", load.req_id)
            if self.metrics is not None:
                self.metrics.kv_transfer_failures.inc()
        finally:
            # Always reported, so the blocks are freed or used: never left allocated.
            self.engine.finish_kv_load(load.req_id, ok, staged)
            tracing.end_span(span, None if ok else "pull failed")

    async def _pull(self, load: KVLoad, handle: KVHandle, span: tracing.Span) -> StagedKV | None:
        """Pull the blocks ``load`` lacks; returns where they landed when not in the engine's
        pool."""
        if handle.compat_hash != self.compat_hash:
            # Give the lease back at once: nobody else will pull it.
            with contextlib.suppress(KVTransferError):
                await self.sink.release(handle.transfer_endpoint, handle.lease_id)
            raise KVLoadFailedError(
                f"the prefill worker {handle.engine_id} runs an incompatible engine "
                "(model, dtype, block size or KV layout differ)"
            )
        remote_ids = list(handle.block_ids[load.first_block :])
        if len(remote_ids) != len(load.local_block_ids):
            raise KVLoadFailedError(
                f"the handle has {len(handle.block_ids)} blocks, the prompt needs "
                f"{load.first_block + len(load.local_block_ids)}"
            )
        if not remote_ids:  # everything was cached here: just give the lease back
            await self.sink.release(handle.transfer_endpoint, handle.lease_id)
            return None
        staging = self.staging
        if staging is None:
            rows = list(load.local_block_ids)
        elif staging.has_room(len(remote_ids)):
            rows = await staging.acquire(len(remote_ids))
        else:  # wait for room, the lease kept alive meanwhile
            rows = await self.sink.hold(
                handle.transfer_endpoint,
                handle.lease_id,
                staging.acquire(len(remote_ids)),
                give_back=staging.release,
            )
        try:
            result = await self.sink.pull(
                handle.transfer_endpoint,
                peer_engine_id=handle.engine_id,
                peer_epoch=handle.epoch,
                lease_id=handle.lease_id,
                remote_block_ids=remote_ids,
                local_block_ids=rows,
                lease_expiry_unix_ms=handle.lease_expiry_unix_ms,
            )
        except BaseException:
            if staging is not None:
                staging.release(rows)
            raise
        self.num_pulled_blocks += len(remote_ids)
        span.set_attribute("baton.bytes", result.num_bytes)
        span.set_attribute("baton.backend", result.backend)
        if self.metrics is not None:
            self.metrics.kv_transfer_seconds.observe(result.seconds)
            self.metrics.kv_transfer_read_seconds.observe(result.read_seconds)
            self.metrics.kv_transfer_bytes.inc(result.num_bytes)
            self.metrics.kv_transfer_blocks.inc(len(remote_ids))
        if staging is None:
            return None
        return StagedKV(list(load.local_block_ids), staging.pool, rows, staging.releaser(rows))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def check_block_hashes(
    prompt_token_ids: list[int],
    handle: KVHandle,
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> None:
    """Raise ``InvalidRequestError`` when the handle's block hashes are not those of this
    prompt under this LoRA adapter and cache salt (its KV would belong to other tokens, or to
    another adapter's model; or the blocks would be cached under another salt)."""
    root = prefix_root(lora_name, cache_salt)
    mine = [h.hash_value for h in hash_request_tokens(prompt_token_ids, block_size, root=root)]
    if list(handle.block_hashes) != mine:
        raise InvalidRequestError("the KV handle's block hashes do not match the prompt")
