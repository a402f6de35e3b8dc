"""CPU cost of streaming a decode step's tokens over gRPC: one ``Generate``-style call per
request vs one ``GenerateStream``-style call for all of them, with the real message types.

    python benchmarks/bench_grpc_streams.py [--streams 16] [--steps 512] [--step-ms 4]

A server process (grpc.aio, as the decode worker) emits one token per request every
``--step-ms`` ("a step"): either one ``GenerateResponse`` on each of ``--streams`` server-streaming
calls, or one ``GenerateStreamResponse`` with an item per request on a single call. The client
(grpc.aio, as the gateway) decodes every message. Printed: CPU microseconds per step on each
side (user + system of the process over the timed steps), in alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from baton.v1 import engine_pb2

SERVICE = "bench.Streams"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _identity(data: bytes) -> bytes:
    return data


async def serve(port: int, steps: int, step_s: float) -> None:
    per_request: list[asyncio.Queue[int]] = []
    shared: list[asyncio.Queue[int]] = []

    async def one_call_per_request(_: bytes, context: Any) -> AsyncIterator[bytes]:
        tokens: asyncio.Queue[int] = asyncio.Queue()
        per_request.append(tokens)
        for _ in range(steps):
            token = await tokens.get()
            yield engine_pb2.GenerateResponse(
                token_ids=[token], num_prompt_tokens=128
            ).SerializeToString()

    async def one_call(request: bytes, context: Any) -> AsyncIterator[bytes]:
        num_streams = int(request)
        tokens: asyncio.Queue[int] = asyncio.Queue()
        shared.append(tokens)
        for _ in range(steps):
            token = await tokens.get()
            items = [
                engine_pb2.GenerateStreamItem(
                    req_id=f"req-{i}",
                    response=engine_pb2.GenerateResponse(token_ids=[token], num_prompt_tokens=128),
                )
                for i in range(num_streams)
            ]
            yield engine_pb2.GenerateStreamResponse(items=items).SerializeToString()

    async def run(request: bytes, context: Any) -> bytes:
        """Drive the steps once every stream of the round is open; reply with CPU us/step."""
        num_streams = int(request)
        while len(per_request) < num_streams and not shared:
            await asyncio.sleep(0.001)
        start = cpu_seconds()
        for step in range(steps):
            for tokens in per_request or shared:
                tokens.put_nowait(step)
            await asyncio.sleep(step_s)
        per_request.clear()
        shared.clear()
        return f"{(cpu_seconds() - start) / steps * 1e6:.0f}".encode()

    server = grpc.aio.server()
    handlers = {
        "PerRequest": grpc.unary_stream_rpc_method_handler(
            one_call_per_request, _identity, _identity
        ),
        "Shared": grpc.unary_stream_rpc_method_handler(one_call, _identity, _identity),
        "Run": grpc.unary_unary_rpc_method_handler(run, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def client_round(port: int, mode: str, num_streams: int, steps: int) -> tuple[str, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:

        async def consume(method: str) -> None:
            stream = channel.unary_stream(
                f"/{SERVICE}/{method}",
                request_serializer=_identity,
                response_deserializer=_identity,
            )
            call = stream(str(num_streams).encode())
            async for data in call:
                if method == "Shared":
                    for item in engine_pb2.GenerateStreamResponse.FromString(data).items:
                        item.response.token_ids  # noqa: B018 (touch it, as the gateway does)
                else:
                    engine_pb2.GenerateResponse.FromString(data).token_ids  # noqa: B018

        method = "PerRequest" if mode == "per-request" else "Shared"
        calls = num_streams if mode == "per-request" else 1
        start = cpu_seconds()
        tasks = [asyncio.create_task(consume(method)) for _ in range(calls)]
        await asyncio.sleep(0.2)  # let every call open before the steps start
        server_us = await channel.unary_unary(
            f"/{SERVICE}/Run", request_serializer=_identity, response_deserializer=_identity
        )(str(num_streams).encode())
        await asyncio.gather(*tasks)
        client_us = (cpu_seconds() - start) / steps * 1e6
        return server_us.decode(), client_us


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--step-ms", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: the server process
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.steps, args.step_ms / 1e3))
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--steps", str(args.steps),
         "--step-ms", str(args.step_ms)]
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.2)
        print(f"{args.streams} streams, {args.steps} steps of {args.step_ms:g} ms")
        print("| mode | server CPU us/step | client CPU us/step |\n|---|---|---|")
        for _ in range(args.rounds):
            for mode in ("per-request", "one call"):
                server_us, client_us = asyncio.run(
                    client_round(port, mode, args.streams, args.steps)
                )
                print(f"| {mode} | {server_us} | {client_us:.0f} |")
    finally:
        server.kill()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
