"""Disaggregated serving when things go wrong: leases that expire, workers killed with SIGKILL
in the middle of a run, Redis restarting under the kvstore.

Every request must either complete with the correct (greedy, float32) output or, when its
decode worker died after streaming tokens, end with a clean error; afterwards every surviving
worker's pool is whole (no running request, no block in use, no lease held; the workers also
check their block pools' invariants whenever they go idle and would stop serving if one broke).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from procs import ENGINE_ARGS, Service, kill, launch, stop, wait_all

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "Baton failure drill. The operator reads every line of the log carefully. " * 8
MAX_TOKENS = 12


def prompts(tokenizer: Any, n: int = 32) -> list[list[int]]:
    return [tokenizer(f"{PREFIX} Case {i}: {i * 7} apples").input_ids for i in range(n)]


class Stack:
    """Services started by one test; all stopped at the end."""

    def __init__(self) -> None:
        self.services: list[Service] = []

    def add(self, kind: str, argv: list[str], env: dict[str, str] | None = None) -> Service:
        service = launch(kind, argv, env)
        self.services.append(service)
        return service

    def worker(self, kind: str, name: str, kvstore: Service | None, *extra: str) -> Service:
        argv = ["--port", "0", "--worker-id", name, *extra, *ENGINE_ARGS]
        if kvstore is not None:
            argv += ["--kvstore", kvstore.address]
        return self.add(kind, argv)

    def gateway(self, decode: list[Service], prefill: list[Service], *extra: str) -> Service:
        wait_all(self.services)  # their addresses come with their ready lines
        argv = ["--port", "0", "--disable-uvicorn-access-log", *extra]
        for d in decode:
            argv += ["--decode-addr", d.address]
        for p in prefill:
            argv += ["--prefill-addr", p.address]
        return self.add("gateway", argv)


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack()
    try:
        yield s
    finally:
        stop(reversed(s.services))


def run_requests(
    base_url: str,
    batch: list[list[int]],
    *,
    stream: bool = False,
    during: Callable[[], None] | None = None,
    after_done: int = 0,
) -> list[str | BaseException]:
    """Greedy completions at concurrency 8; each result is the text or the exception raised.
    ``during`` runs in a thread once ``after_done`` requests have completed."""
    results: list[str | BaseException] = [RuntimeError("not run")] * len(batch)
    done = 0
    fired = threading.Event()

    async def run() -> None:
        nonlocal done
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        gate = asyncio.Semaphore(8)
        trigger: asyncio.Future[None] | None = None

        async def one(i: int) -> None:
            nonlocal done, trigger
            async with gate:
                try:
                    kwargs: dict[str, Any] = dict(
                        model=MODEL,
                        prompt=batch[i],
                        max_tokens=MAX_TOKENS,
                        temperature=0.0,
                        extra_body={"ignore_eos": True},
                        timeout=120,
                    )
                    if stream:
                        text = ""
                        async for chunk in await client.completions.create(stream=True, **kwargs):
                            text += chunk.choices[0].text if chunk.choices else ""
                        results[i] = text
                    else:
                        r = await client.completions.create(**kwargs)
                        results[i] = r.choices[0].text
                except Exception as e:
                    results[i] = e
                done += 1
                if during is not None and done >= after_done and not fired.is_set():
                    fired.set()
                    trigger = asyncio.ensure_future(asyncio.to_thread(during))

        try:
            await asyncio.gather(*(one(i) for i in range(len(batch))))
            if trigger is not None:
                await trigger
        finally:
            await client.close()

    asyncio.run(run())
    return results


def assert_whole(*workers: Service, wait_s: float = 10.0) -> None:
    """No running request, no block in use and no lease on any live worker (within wait_s)."""
    deadline = time.monotonic() + wait_s
    for w in workers:
        while True:
            assert w.alive, w.output()
            # Idle workers check their block pool's invariants; a broken one kills the engine.
            assert "engine loop died" not in "".join(w.lines), w.output()
            m = w.metrics()
            state = (
                m["baton:num_requests_running"],
                m["baton:num_requests_waiting"],
                m["baton:kv_cache_usage_perc"],
                m.get("baton:kv_leases_active", 0.0),
            )
            if state == (0, 0, 0.0, 0.0):
                break
            assert time.monotonic() < deadline, f"{w.argv}: running/waiting/usage/leases {state}"
            time.sleep(0.2)


def reference(stack: Stack, decode: Service, batch: list[list[int]]) -> list[str | BaseException]:
    """The outputs of aggregated serving on ``decode`` (its own local prefill)."""
    gw = stack.gateway([decode], [])
    wait_all([gw])
    return run_requests(gw.address, batch)


def test_expired_leases_make_decode_recompute(stack: Stack, tokenizer: Any) -> None:
    prefill = stack.worker("prefill", "p", None, "--kv-lease-ms", "1")
    decode = stack.worker("decode", "d", None)
    gw = stack.gateway([decode], [prefill], "--remote-prefill-threshold", "0")
    wait_all(stack.services)
    batch = prompts(tokenizer, 6)
    want = reference(stack, decode, batch)
    got = run_requests(gw.address, batch)
    assert got == want
    assert prefill.metrics()["baton:kv_lease_expired_total"] > 0
    assert decode.metrics()["baton:kv_transfer_failures_total"] > 0
    assert_whole(prefill, decode)


def test_incompatible_prefill_worker_is_refused_and_prompt_recomputed(
    stack: Stack, tokenizer: Any
) -> None:
    prefill = stack.worker("prefill", "p", None, "--block-size", "32")  # a different KV layout
    decode = stack.worker("decode", "d", None)
    gw = stack.gateway([decode], [prefill], "--remote-prefill-threshold", "0")
    wait_all(stack.services)
    batch = prompts(tokenizer, 6)
    want = reference(stack, decode, batch)
    assert run_requests(gw.address, batch) == want
    assert decode.metrics()["baton:kv_transfer_failures_total"] == len(batch)
    assert "incompatible engine" in "".join(decode.lines)
    assert_whole(prefill, decode, wait_s=3.0)  # leases given back at once, not at expiry


def test_prefill_killed_mid_run_costs_no_request(stack: Stack, tokenizer: Any) -> None:
    prefill = stack.worker("prefill", "p", None)
    decode = stack.worker("decode", "d", None)
    gw = stack.gateway([decode], [prefill], "--remote-prefill-threshold", "0")
    wait_all(stack.services)
    batch = prompts(tokenizer)
    want = reference(stack, decode, batch)
    got = run_requests(gw.address, batch, during=lambda: kill(prefill), after_done=6)
    assert not prefill.alive
    assert got == want  # every request completed, correctly
    assert_whole(decode)


def test_decode_killed_mid_run_ends_cleanly_and_survivor_serves(
    stack: Stack, tokenizer: Any
) -> None:
    prefill = stack.worker("prefill", "p", None, "--kv-lease-ms", "3000")
    victim = stack.worker("decode", "d0", None)
    survivor = stack.worker("decode", "d1", None)
    gw = stack.gateway([victim, survivor], [prefill], "--remote-prefill-threshold", "0")
    wait_all(stack.services)
    batch = prompts(tokenizer)
    want = reference(stack, survivor, batch)
    got = run_requests(gw.address, batch, stream=True, during=lambda: kill(victim), after_done=6)
    assert not victim.alive
    errors = [g for g in got if isinstance(g, BaseException)]
    for g, w in zip(got, want, strict=True):
        if not isinstance(g, BaseException):
            assert g == w
    for e in errors:  # a clean error the SDK understands, not a hang or a torn stream
        assert isinstance(e, openai.APIError), repr(e)
    assert len(errors) < len(batch) // 2
    # New requests go to the survivor only.
    assert run_requests(gw.address, batch[:8]) == want[:8]
    assert_whole(prefill, survivor)


def test_kvstore_survives_redis_restart(stack: Stack, tokenizer: Any, redis_server: Any) -> None:
    from baton_engine.kv_cache.hashing import hash_request_tokens
    from baton_kvstore.client import KVStoreClient

    kvstore = stack.add("kvstore", ["--port", "0", "--redis-url", redis_server.url])
    wait_all(stack.services)
    prefill = stack.worker("prefill", "p", kvstore)
    decode = stack.worker("decode", "d", kvstore)
    gw = stack.gateway([], [], "--kvstore", kvstore.address, "--remote-prefill-threshold", "0")
    wait_all(stack.services)
    batch = prompts(tokenizer, 8)
    hashes = [h.hash_value for h in hash_request_tokens(batch[0], 16)]

    async def directory() -> tuple[set[str], dict[str, int]]:
        async with KVStoreClient(kvstore.address) as client:
            workers = {w.worker_id for w in await client.list_workers()}
            matches = {m.worker_id: m.num_blocks for m in await client.lookup_prefix(hashes, None)}
        return workers, matches

    def wait_for_index(timeout_s: float = 30.0) -> None:
        # (the workers heartbeat and publish from busy processes: on a loaded 2-core machine
        # that can take seconds)
        deadline = time.monotonic() + timeout_s
        seen: object = None
        while True:
            try:
                workers, matches = asyncio.run(directory())
                if workers == {"p", "d"} and matches.get("d", 0) >= 4:
                    return
                seen = (workers, matches)
            except Exception as e:
                seen = e
            assert time.monotonic() < deadline, (
                f"the kvstore did not rebuild its directory/index; last seen: {seen!r}"
            )
            time.sleep(0.3)

    want = run_requests(gw.address, batch)
    assert all(isinstance(w, str) for w in want)
    wait_for_index()
    redis_server.restart()  # an empty Redis: workers must re-register and resync
    got = run_requests(gw.address, batch)
    assert got == want
    wait_for_index()
    assert kvstore.alive
    assert_whole(prefill, decode)


def test_a_dead_decode_workers_stream_call_ends_whole(stack: Stack) -> None:
    """The gateway's one GenerateStream call to a decode worker (``GenerateStreams``): when the
    worker dies mid-generation the request on it fails with a gRPC error, and the call's
    request stream ends too, so that no task of the gateway is left waiting to send on it."""
    import grpc

    from baton.v1 import common_pb2, engine_pb2_grpc
    from baton_gateway import codec
    from baton_gateway.client import GenerateStreams

    victim = stack.worker("decode", "d0", None)
    wait_all(stack.services)

    async def run() -> None:
        async with grpc.aio.insecure_channel(victim.address) as channel:
            streams = GenerateStreams(engine_pb2_grpc.DecodeServiceStub(channel))
            params = common_pb2.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            call = streams.generate(codec.generate_request("r", [1, 2, 3], params), {})
            current = streams._current
            assert current is not None
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in call:
                    if victim.alive:
                        kill(victim)
            for _ in range(50):  # bounded: 5 s
                if current.messages.ag_frame is None:  # the request stream has ended
                    break
                await asyncio.sleep(0.1)
            assert current.messages.ag_frame is None
            assert not current.open

    asyncio.run(run())
