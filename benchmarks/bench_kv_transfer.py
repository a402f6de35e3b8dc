"""KV transfer bandwidth between two processes on this machine.

Moves 64 MiB of KV (256 blocks of 256 KiB, scattered ids on both sides; ``--layers 32``: 512 MiB
in Llama-3.1-8B's 2 MiB blocks) from a source process
(``KVTransferSource`` on a loopback gRPC server) into the benchmark process's pool with
``KVTransferSink.pull`` (handshake excluded, lease RPCs included), over:

- ``nixl``      NIXL READ, UCX default transports (CMA between processes), ``UCX_NET_DEVICES=lo``
- ``nixl-tcp``  NIXL READ with ``UCX_TLS=tcp`` (a stand-in for a cross-host link)
- ``grpc``      the ``PullBlocks`` stream, 4 MiB chunks
- ``shm``       the ceiling: a child copies the same scattered blocks out of a shared-memory
                segment into its own pool with numpy (one copy, no protocol), timed in the child
- ``nixl-alldev`` (GPUs) NIXL READ with every UCX device allowed (no ``UCX_NET_DEVICES=lo``)
- ``copy``      (GPUs) the ceiling: the same bytes copied from the source GPU to the destination
                GPU in one contiguous peer-to-peer copy (torch: the source GPU writes)
- ``copy-pull`` (GPUs) the same copy run by the destination GPU, reading the source's memory,
                as a NIXL READ over CUDA IPC does (cudaMemcpyAsync through ctypes)

With ``--devices cuda:0,cuda:1`` the source's pool lives on the first GPU and the sink's on the
second (NIXL registers VRAM; ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` as ``baton serve`` sets for
GPUs); ``--env KEY=VAL`` adds UCX/NIXL settings to both processes (``UCX_PROTO_INFO=y`` prints
the protocol UCX picked).

Each mode runs one warm-up and ``--reps`` timed pulls; the table gives median and best GB/s
(1e9 bytes/s) and the NIXL/ceiling ratio of medians. The bytes are checked after each mode.

    python benchmarks/bench_kv_transfer.py [--reps 7] [--modes nixl,nixl-tcp,grpc,shm]
                                           [--output-json benchmarks/out/kv_transfer.json]
    python benchmarks/bench_kv_transfer.py --devices cuda:0,cuda:1 --modes nixl,nixl-alldev,copy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import grpc
import numpy as np
import torch

from baton_kvtransfer import KVTransferSink, KVTransferSource, LeaseTable, compat_hash, nixl_agent
from baton_kvtransfer import sink as kv_sink

NUM_BLOCKS = int(os.environ.get("BENCH_KV_BLOCKS", "256"))  # --blocks: how many move
NUM_POOL_BLOCKS = max(512, 2 * NUM_BLOCKS)  # per side
# layers, K/V, block_size, kv_heads, head_dim: 256 KiB in bf16; --layers 32 makes Llama-3.1-8B's
# 2 MiB blocks (spawned children see the setting through the environment)
BLOCK_SHAPE = (int(os.environ.get("BENCH_KV_LAYERS", "4")), 2, 16, 8, 128)
DTYPE = torch.bfloat16
COMPAT = compat_hash("bench", "bfloat16", 16, "blocks,layers,kv,block_size,kv_heads,dim")
MODES = ("nixl", "nixl-tcp", "nixl-alldev", "grpc", "shm", "copy", "copy-pull")
GPU_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
START_TIMEOUT_S = 60.0


def source_pool(seed: int = 0, device: str = "cpu", total_blocks: int = 0) -> torch.Tensor:
    """The source's pool: ``NUM_POOL_BLOCKS`` seeded blocks, in a pool of ``total_blocks`` (the
    rest left unset: a large registered pool as a serving worker has, without filling it)."""
    g = torch.Generator().manual_seed(seed)
    data = (torch.rand((NUM_POOL_BLOCKS, *BLOCK_SHAPE), generator=g) * 8 + 1).to(DTYPE)
    if total_blocks <= NUM_POOL_BLOCKS:
        return data.to(device)
    pool = torch.empty((total_blocks, *BLOCK_SHAPE), dtype=DTYPE, device=device)
    pool[:NUM_POOL_BLOCKS] = data.to(device)
    return pool


def block_ids(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_POOL_BLOCKS, generator=g)[:NUM_BLOCKS].tolist()


REMOTE_IDS = block_ids(1)
LOCAL_IDS = block_ids(2)
if os.environ.get("BENCH_KV_CONTIGUOUS") == "1":  # --contiguous (spawned children see it too)
    REMOTE_IDS = LOCAL_IDS = list(range(NUM_BLOCKS))


# -- source process ------------------------------------------------------------------------------


def run_source(
    conn: Connection, backend: str, env: dict[str, str], device: str, total_blocks: int
) -> None:
    os.environ.update(env)
    asyncio.run(_serve(conn, backend, device, total_blocks))


async def _serve(conn: Connection, backend: str, device: str, total_blocks: int) -> None:
    loop = asyncio.get_running_loop()
    leases = LeaseTable(lambda req_id, reason: None)
    source = KVTransferSource(
        source_pool(device=device, total_blocks=total_blocks), engine_id="bench-src", epoch=1,
        compat_hash=COMPAT, leases=leases, backend=backend,
    )  # fmt: skip
    server = grpc.aio.server()
    source.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()

    def on_command() -> None:
        try:
            req_id = conn.recv()
        except EOFError:
            stop.set()
            return
        lease = leases.grant(req_id, REMOTE_IDS)
        conn.send((lease.lease_id, lease.expiry_unix_ms))

    loop.add_reader(conn.fileno(), on_command)
    conn.send(port)
    await stop.wait()
    await server.stop(None)
    source.close()


@contextmanager
def start_source(
    backend: str, env: dict[str, str], device: str, total_blocks: int
) -> Iterator[tuple[Connection, str]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (child, backend, env, device, total_blocks)
    proc = ctx.Process(target=run_source, args=args, daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(START_TIMEOUT_S):
            raise TimeoutError("the source process did not start")
        yield parent, f"127.0.0.1:{parent.recv()}"
    finally:
        proc.kill()
        proc.join(10)
        parent.close()


def bench_pull(
    mode: str, reps: int, devices: tuple[str, str], extra_env: dict[str, str], total_blocks: int
) -> tuple[list[float], list[float]]:
    """Seconds per pull: from the slot to the release (the lease RPCs included), and of the
    bytes' movement alone."""
    backend = "grpc" if mode == "grpc" else "nixl"
    env = {} if mode == "nixl-alldev" else {"UCX_NET_DEVICES": "lo"}
    if mode == "nixl-tcp":
        env["UCX_TLS"] = "tcp"
    if devices[0] != "cpu":
        env.update(GPU_ENV)
    env.update(extra_env)
    saved = {k: os.environ.get(k) for k in ("UCX_NET_DEVICES", "UCX_TLS", *env)}
    for k in ("UCX_NET_DEVICES", "UCX_TLS"):
        os.environ.pop(k, None)
    os.environ.update(env)  # the sink's agent reads UCX settings when it is created
    pool = torch.zeros(
        (max(NUM_POOL_BLOCKS, total_blocks), *BLOCK_SHAPE), dtype=DTYPE, device=devices[1]
    )
    try:
        with start_source(backend, env, devices[0], total_blocks) as (conn, endpoint):

            async def main() -> tuple[list[float], list[float]]:
                sink = KVTransferSink(
                    pool, engine_id="bench-sink", epoch=1, compat_hash=COMPAT, backend=backend
                )
                seconds: list[float] = []
                read_seconds: list[float] = []
                try:
                    for rep in range(reps + 1):  # the first one warms up (handshake, connect)
                        conn.send(f"req-{rep}")
                        lease_id, expiry_ms = conn.recv()
                        result = await sink.pull(
                            endpoint,
                            peer_engine_id="bench-src",
                            peer_epoch=1,
                            lease_id=lease_id,
                            remote_block_ids=REMOTE_IDS,
                            local_block_ids=LOCAL_IDS,
                            lease_expiry_unix_ms=expiry_ms,  # as a decode worker has it
                        )
                        assert result.backend == backend, result
                        if rep:
                            seconds.append(result.seconds)
                            read_seconds.append(result.read_seconds)
                finally:
                    await sink.close()
                return seconds, read_seconds

            seconds, read_seconds = asyncio.run(main())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    expected = source_pool()[REMOTE_IDS]
    got = pool[LOCAL_IDS].cpu()
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), mode
    return seconds, read_seconds


def bench_copy(reps: int, devices: tuple[str, str]) -> list[float]:
    """The GPU ceiling: the same number of bytes copied from the source GPU to the destination
    GPU in one contiguous copy (torch, peer-to-peer)."""
    src = source_pool(device=devices[0])[:NUM_BLOCKS]
    dst = torch.zeros_like(src, device=devices[1])
    seconds = []
    for rep in range(reps + 1):
        torch.cuda.synchronize(devices[0])
        torch.cuda.synchronize(devices[1])
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(devices[1])
        if rep:
            seconds.append(time.perf_counter() - start)
    assert torch.equal(dst.view(torch.int16), src.to(dst.device).view(torch.int16))
    return seconds


def _cudart() -> Any:
    """The CUDA runtime library torch runs on (ctypes), for the one call torch does not offer:
    a peer copy launched on the destination GPU."""
    import ctypes
    import ctypes.util
    import glob

    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = ctypes.util.find_library("cudart")
    candidates = ([found] if found else []) + sorted(
        glob.glob(os.path.join(site, "nvidia", "**", "libcudart.so*"), recursive=True)
    )
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("libcudart not found")


def bench_copy_pull(reps: int, devices: tuple[str, str]) -> list[float]:
    """The same bytes copied by the destination GPU's copy engine, reading the source GPU's
    memory (cudaMemcpyAsync on a stream of the destination), as a NIXL READ over CUDA IPC
    does; torch's ``copy_`` runs on the source GPU and writes to the destination."""
    import ctypes

    cudart = _cudart()
    src = source_pool(device=devices[0])[:NUM_BLOCKS]
    dst = torch.zeros_like(src, device=devices[1])
    src_index, dst_index = torch.device(devices[0]).index, torch.device(devices[1]).index
    seconds = []
    with torch.cuda.device(dst.device):
        cudart.cudaDeviceEnablePeerAccess(ctypes.c_int(src_index), ctypes.c_uint(0))
        stream = torch.cuda.current_stream(dst.device)
        for rep in range(reps + 1):
            torch.cuda.synchronize(devices[0])
            torch.cuda.synchronize(devices[1])
            start = time.perf_counter()
            err = cudart.cudaMemcpyAsync(
                ctypes.c_void_p(dst.data_ptr()),
                ctypes.c_void_p(src.data_ptr()),
                ctypes.c_size_t(src.numel() * src.element_size()),
                ctypes.c_int(4),  # cudaMemcpyDefault: unified addressing finds the devices
                ctypes.c_void_p(stream.cuda_stream),
            )
            assert err == 0, f"cudaMemcpyAsync: error {err}"
            torch.cuda.synchronize(dst_index)
            if rep:
                seconds.append(time.perf_counter() - start)
    assert torch.equal(dst.view(torch.int16), src.to(dst.device).view(torch.int16))
    return seconds


# -- the shared-memory ceiling -------------------------------------------------------------------


def shm_copier(name: str, reps: int, conn: Connection) -> None:
    shm = SharedMemory(name=name)
    try:
        bb = shm.size // NUM_POOL_BLOCKS
        src = np.ndarray((NUM_POOL_BLOCKS, bb), dtype=np.uint8, buffer=shm.buf)
        dst = np.ones((NUM_POOL_BLOCKS, bb), dtype=np.uint8)  # touched: no page faults timed
        seconds = []
        for rep in range(reps + 1):
            start = time.perf_counter()
            for s, d in zip(REMOTE_IDS, LOCAL_IDS, strict=True):
                dst[d] = src[s]
            if rep:
                seconds.append(time.perf_counter() - start)
        ok = bool(np.array_equal(dst[LOCAL_IDS], src[REMOTE_IDS]))
        del src
        conn.send((seconds, ok))
    finally:
        shm.close()


def bench_shm(reps: int) -> list[float]:
    pool = source_pool()
    raw = pool.view(torch.uint8).numpy().reshape(NUM_POOL_BLOCKS, -1)
    shm = SharedMemory(create=True, size=raw.nbytes)
    try:
        np.ndarray(raw.shape, dtype=np.uint8, buffer=shm.buf)[:] = raw
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=shm_copier, args=(shm.name, reps, child), daemon=True)
        proc.start()
        try:
            if not parent.poll(120):
                raise TimeoutError("the shared-memory copier did not finish")
            seconds, ok = parent.recv()
        finally:
            proc.kill()
            proc.join(10)
        assert ok, "shared-memory copy mismatch"
        return list(seconds)
    finally:
        shm.close()
        shm.unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--output-json", default=None)
    p.add_argument(
        "--devices", default="cpu,cpu", help="source and destination pools, e.g. cuda:0,cuda:1"
    )
    p.add_argument("--env", action="append", default=[], help="KEY=VAL for both processes")
    p.add_argument(
        "--contiguous",
        action="store_true",
        help="move blocks 0..N-1 on both sides (NIXL merges them into one descriptor), not\n"
        "scattered ids (256 descriptors of 256 KiB)",
    )
    p.add_argument(
        "--pool-gib",
        type=float,
        default=0.0,
        help="size of each side's registered pool (default: just the 512 blocks, 128 MiB)",
    )
    p.add_argument("--layers", type=int, default=4, help="layers per block (4: 256 KiB blocks)")
    p.add_argument("--blocks", type=int, default=256, help="blocks moved per pull")
    p.add_argument("--notify", action="store_true", help="attach a NIXL notification to each READ")
    p.add_argument(
        "--always-extend",
        action="store_true",
        help="extend the lease before every read, even with ample time left on it",
    )
    p.add_argument(
        "--max-run-mib",
        type=float,
        default=0.0,
        help="cut contiguous runs into NIXL descriptors of at most this many MiB (0: never)",
    )
    p.add_argument(
        "--spin-ms",
        type=float,
        default=None,
        help="the sink's NIXL poll: spin this long before sleeping between checks\n"
        "(default: the library's)",
    )
    args = p.parse_args()
    wanted = {
        "BENCH_KV_CONTIGUOUS": "1" if args.contiguous else "",
        "BENCH_KV_LAYERS": str(args.layers),
        "BENCH_KV_BLOCKS": str(args.blocks),
    }
    if any(os.environ.get(k, "") != v for k, v in wanted.items()):
        os.environ.update(wanted)  # the shapes and ids are set at import: start again
        os.execv(sys.executable, [sys.executable, *sys.argv])
    nixl_agent.NOTIFY_READS = args.notify
    if args.always_extend:
        kv_sink.SKIP_EXTEND_MARGIN_S = float("inf")
    nixl_agent.MAX_RUN_BYTES = int(args.max_run_mib * 2**20)
    if args.spin_ms is not None:
        nixl_agent.SPIN_S = args.spin_ms / 1000
    src_dev, _, dst_dev = args.devices.partition(",")
    devices = (src_dev, dst_dev or src_dev)
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    block_bytes = math.prod(BLOCK_SHAPE) * 2
    total_blocks = int(args.pool_gib * 2**30) // block_bytes
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in MODES:
            p.error(f"unknown mode {mode}: expected some of {','.join(MODES)}")
    num_bytes = NUM_BLOCKS * block_bytes
    rows: dict[str, dict[str, float]] = {}
    for mode in modes:
        if mode == "shm":
            seconds = read_seconds = bench_shm(args.reps)
        elif mode == "copy":
            seconds = read_seconds = bench_copy(args.reps, devices)
        elif mode == "copy-pull":
            seconds = read_seconds = bench_copy_pull(args.reps, devices)
        else:
            seconds, read_seconds = bench_pull(mode, args.reps, devices, extra_env, total_blocks)
        rows[mode] = {
            "median_gbps": num_bytes / statistics.median(seconds) / 1e9,
            "best_gbps": num_bytes / min(seconds) / 1e9,
            "median_ms": statistics.median(seconds) * 1e3,
            "read_median_ms": statistics.median(read_seconds) * 1e3,
            "read_median_gbps": num_bytes / statistics.median(read_seconds) / 1e9,
        }
        print(f"{mode}: done", flush=True)
    layout = "contiguous" if args.contiguous else "scattered"
    print(
        f"\n{num_bytes / 2**20:.0f} MiB in {NUM_BLOCKS} {layout} blocks of "
        f"{num_bytes // NUM_BLOCKS >> 10} KiB, {args.reps} reps; NIXL poll spin "
        f"{nixl_agent.SPIN_S * 1000:.1f} ms"
    )
    print("(a pull: from its slot to the release, the lease RPCs included; read: the bytes alone)")
    print(
        f"{'mode':<11} {'median GB/s':>12} {'best GB/s':>10} {'median ms':>10} "
        f"{'read ms':>8} {'read GB/s':>10}"
    )
    for mode, row in rows.items():
        print(
            f"{mode:<11} {row['median_gbps']:>12.2f} {row['best_gbps']:>10.2f} "
            f"{row['median_ms']:>10.2f} {row['read_median_ms']:>8.2f} "
            f"{row['read_median_gbps']:>10.2f}"
        )
    ratios = {}
    for ceiling in ("shm", "copy", "copy-pull"):
        if ceiling not in rows:
            continue
        for mode in ("nixl", "nixl-tcp", "nixl-alldev", "grpc"):
            if mode in rows:
                key = f"{mode}/{ceiling}"
                ratios[key] = rows[mode]["median_gbps"] / rows[ceiling]["median_gbps"]
                print(f"{mode}/ceiling (medians): {ratios[key]:.2f}")
    if args.output_json:
        out = {
            "num_bytes": num_bytes,
            "num_blocks": NUM_BLOCKS,
            "block_bytes": num_bytes // NUM_BLOCKS,
            "reps": args.reps,
            "devices": devices,
            "modes": rows,
            "ratios": ratios,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
