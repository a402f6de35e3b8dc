"""The NIXL transport: one agent per pool, the whole pool registered once, READs by the sink.

Environment: UCX picks its transports from the environment when an agent is created. On a
machine without RDMA NICs set ``UCX_NET_DEVICES=lo`` (CPU-only machines, tests); the default
transports then copy DRAM between processes with CMA (single copy), and ``UCX_TLS=tcp`` forces
the TCP path (a stand-in for a cross-host link). Between GPUs of one host, set
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` or READs silently fall back to a slow emulation.

Progress: agents run without NIXL's progress thread (with it, an idle agent busy-polls a core);
the initiator polls its transfer from the asyncio loop, and the target must call ``progress``
often while a peer may read from it (connection setup and the TCP path need it).

NIXL's own metadata listener (which binds 0.0.0.0) is never used: agent metadata travels only
in the gRPC handshake (see ``metadata.py``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
from typing import Any

import numpy as np
import torch

from baton_kvtransfer.blocks import BlockRun, block_bytes, check_block_ids, merge_runs, split_runs
from baton_kvtransfer.errors import KVTransferError, TransferFailedError
from baton_kvtransfer.metadata import MemKind, PoolMetadata

logger = logging.getLogger(__name__)

BACKENDS = ("nixl", "grpc")
# How a READ is waited for: checked at every turn of the event loop for this long, then every
# ``poll_s``. asyncio's timers tick in whole milliseconds (epoll), so sleeping from the start
# rounds a GPU-to-GPU READ of a few hundred MB (~1-2 ms over NVLink) up by as much as it lasts.
SPIN_S = 0.002
# Attach the lease id to each READ as a NIXL notification for the source (which only counts
# them). Off: see benchmarks/RESULTS.md (issue 6, fifteenth session) for what one costs.
NOTIFY_READS = False
# Cut a READ's contiguous runs into descriptors of at most this many bytes (0: never), which
# UCX may copy on several CUDA streams at once. An experiment (bench_kv_transfer.py
# --max-run-mib), off by default until measured on GPUs.
MAX_RUN_BYTES = 0
_agent_counter = itertools.count()


def agent_name(engine_id: str, role: str) -> str:
    """Unique per agent in this process, and across processes of one engine (the pid)."""
    return f"{engine_id}-{role}-{os.getpid()}-{next(_agent_counter)}"


def _new_agent(name: str) -> Any:
    import nixl

    config = nixl.nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
    )
    agent = nixl.nixl_agent(name, config)
    if "UCX" not in agent.backends:  # NIXL only warns when a plugin is missing
        raise KVTransferError("NIXL has no UCX backend")
    return agent


@functools.cache
def nixl_available() -> bool:
    """True if NIXL imports and an agent with the UCX backend can be created here."""
    try:
        _new_agent(agent_name("baton-probe", "probe"))
    except Exception as e:  # ImportError, a UCX setup failure, a missing plugin
        logger.info("NIXL is unavailable here (%s: %s)", type(e).__name__, e)
        return False
    return True


def resolve_backend(name: str) -> str:
    """``--kv-transfer``: "nixl" and "grpc" as given, "auto" -> "nixl" if available."""
    if name == "auto":
        return "nixl" if nixl_available() else "grpc"
    if name not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}: expected nixl, grpc or auto")
    return name


@functools.cache
def _nixl_errors() -> tuple[type[Exception], ...]:
    import nixl

    found = [
        value
        for key, value in vars(nixl).items()
        if key.startswith("nixl")
        and key.endswith("Error")
        and isinstance(value, type)
        and issubclass(value, Exception)
    ]
    return (*found, RuntimeError)


class NixlAgent:
    """A NIXL agent with one KV pool registered whole (DRAM, or VRAM for a CUDA pool)."""

    def __init__(self, name: str, pool: torch.Tensor) -> None:
        self.name = name
        self.mem_kind: MemKind = "VRAM" if pool.is_cuda else "DRAM"
        self.device_id = pool.get_device() if pool.is_cuda else 0
        self.base_address = pool.data_ptr()
        self.num_blocks = pool.shape[0]
        self.block_bytes = block_bytes(pool)
        self._agent = _new_agent(name)
        self._registered: Any = self._agent.register_memory(pool)
        self._peers: dict[str, Any] = {}  # peer agent name -> the name as NIXL returned it
        self.num_notifs_total = 0

    def metadata(self) -> PoolMetadata:
        return PoolMetadata(
            self.mem_kind,
            self.device_id,
            self.base_address,
            self.num_blocks,
            self.block_bytes,
            self._agent.get_agent_metadata(),
        )

    def add_peer(self, peer: PoolMetadata) -> str:
        """Load a peer's agent metadata; returns its agent name."""
        try:
            raw = self._agent.add_remote_agent(peer.agent_metadata)
        except _nixl_errors() as e:
            raise TransferFailedError(f"cannot load the peer's NIXL metadata: {e}") from e
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._peers[name] = raw
        return name

    def remove_peer(self, name: str) -> None:
        raw = self._peers.pop(name, None)
        if raw is None:
            return
        try:
            self._agent.remove_remote_agent(raw)
        except _nixl_errors() as e:
            logger.debug("removing NIXL peer %s: %s", name, e)

    def progress(self) -> None:
        """Drive UCX (connection setup, the target side of TCP transfers) and drop the
        notifications peers attach to their READs."""
        notifs = self._agent.get_new_notifs()
        self.num_notifs_total += sum(len(v) for v in notifs.values())

    async def read(
        self,
        peer_name: str,
        peer: PoolMetadata,
        runs: list[BlockRun],
        *,
        tag: bytes,
        timeout_s: float,
        poll_s: float = 0.0005,
    ) -> int:
        """READ the runs' blocks from the peer's pool into ours; returns the bytes moved.
        Polls with ``asyncio.sleep`` (see ``SPIN_S``) so the loop keeps running (but between
        DRAM pools UCX may finish the copy inside ``transfer``, holding the loop for the copy's
        duration: ~10 ms per 64 MiB here). Any NIXL error, an "ERR" state or the timeout raises
        ``TransferFailedError``."""
        raw_peer = self._peers.get(peer_name)
        if raw_peer is None:
            raise TransferFailedError(f"NIXL peer {peer_name} is not loaded (it was dropped)")
        if not runs:
            return 0
        bb = self.block_bytes
        if MAX_RUN_BYTES:
            runs = split_runs(runs, max(1, MAX_RUN_BYTES // bb))
        local = np.array(
            [
                (self.base_address + r.dst_block_id * bb, r.num_blocks * bb, self.device_id)
                for r in runs
            ],
            dtype=np.uint64,
        )
        remote = np.array(
            [
                (peer.base_address + r.src_block_id * bb, r.num_blocks * bb, peer.device_id)
                for r in runs
            ],
            dtype=np.uint64,
        )
        errors = _nixl_errors()
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, self.mem_kind),
                agent.get_xfer_descs(remote, peer.mem_kind),
                raw_peer,
                tag,
            )
        except errors as e:
            raise TransferFailedError(f"NIXL READ from {peer_name} not created: {e}") from e
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            state = agent.transfer(handle)
            spin_until = loop.time() + SPIN_S
            while state == "PROC":
                now = loop.time()
                if now > deadline:
                    raise TransferFailedError(f"NIXL READ from {peer_name} timed out")
                await asyncio.sleep(0 if now < spin_until else poll_s)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferFailedError(f"NIXL READ from {peer_name} failed (state {state})")
        except errors as e:
            raise TransferFailedError(f"NIXL READ from {peer_name} failed: {e}") from e
        finally:
            try:  # cancels the transfer if it is still in flight
                agent.release_xfer_handle(handle)
            except errors as e:
                logger.error("releasing a NIXL transfer handle from %s failed: %s", peer_name, e)
        return int(local[:, 1].sum())

    def close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        if self._registered is None:
            return
        try:
            self._agent.deregister_memory(self._registered)
        except _nixl_errors() as e:
            logger.debug("deregistering the KV pool from NIXL: %s", e)
        self._registered = None

    def register(self, pool: torch.Tensor) -> None:
        """Register ``pool`` again after ``close`` (sleep mode: the same pool, its memory
        back at another address); peers must load the new ``metadata``."""
        assert self._registered is None, "close first"
        self.base_address = pool.data_ptr()
        self._registered = self._agent.register_memory(pool)


class NixlBlockReader:
    """Reads a peer's blocks with NIXL READs from its registered pool into ours."""

    name = "nixl"

    def __init__(self, agent: NixlAgent, peer: PoolMetadata, *, timeout_s: float) -> None:
        self.agent = agent
        self.peer = peer
        self.timeout_s = timeout_s
        self.peer_name = agent.add_peer(peer)

    async def read(self, lease_id: str, remote: list[int], local: list[int]) -> int:
        check_block_ids(remote, self.peer.num_blocks, "remote")
        return await self.agent.read(
            self.peer_name,
            self.peer,
            merge_runs(remote, local),
            tag=lease_id.encode() if NOTIFY_READS else b"",
            timeout_s=self.timeout_s,
        )

    def close(self) -> None:
        self.agent.remove_peer(self.peer_name)
