"""The kvstore's directory and prefix index, on both stores (memory and a real redis-server).

Every test body runs under ``asyncio.run`` with a deadline, against a store made inside it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from baton_engine.errors import InvalidRequestError
from baton_engine.kv_cache.hashing import hash_request_tokens
from baton_kvstore import codec
from baton_kvstore.codec import KVEvent, PrefixMatch, WorkerInfo, WorkerLoad
from baton_kvstore.redis_store import RedisStore
from baton_kvstore.store import (
    BaseKVStore,
    MemoryStore,
    StoreUnavailableError,
    create_store,
    plan_batch,
)

BODY_TIMEOUT_S = 15.0


def chain(num_blocks: int, seed: int = 0) -> list[bytes]:
    """The chained hashes of a prompt of ``num_blocks`` full 16-token blocks."""
    tokens = [seed * 100_000 + i for i in range(16 * num_blocks)]
    return [h.hash_value for h in hash_request_tokens(tokens, 16)]


def worker(worker_id: str, role: codec.Role = "decode", **kw: Any) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"127.0.0.1:{abs(hash(worker_id)) % 50000 + 1000}", **kw)


def stored(seq: int, hashes: list[bytes]) -> KVEvent:
    return KVEvent(seq, "stored", tuple(hashes))


def removed(seq: int, hashes: list[bytes]) -> KVEvent:
    return KVEvent(seq, "removed", tuple(hashes))


def cleared(seq: int) -> KVEvent:
    return KVEvent(seq, "cleared")


def run(url: str | None, body: Callable[[BaseKVStore], Awaitable[None]]) -> None:
    async def main() -> None:
        store = create_store(url)
        try:
            await asyncio.wait_for(body(store), BODY_TIMEOUT_S)
        finally:
            await store.close()

    asyncio.run(main())


@pytest.fixture(params=["memory", "redis"])
def store_url(request: pytest.FixtureRequest) -> str | None:
    if request.param == "memory":
        return None
    url: str = request.getfixturevalue("redis_server").url
    return url


async def counts(store: BaseKVStore, hashes: list[bytes], role: codec.Role | None = None) -> Any:
    return {m.worker_id: m.num_blocks for m in await store.lookup_prefix(hashes, role)}


def test_create_store_picks_by_url(redis_server: Any) -> None:
    assert isinstance(create_store(None), MemoryStore)
    assert isinstance(create_store(redis_server.url), RedisStore)
    with pytest.raises(InvalidRequestError, match="unsupported store URL"):
        create_store("mysql://x")


def test_plan_batch() -> None:
    assert plan_batch(None, [stored(1, [])]) is None  # unknown worker
    assert plan_batch(None, [cleared(7), stored(8, [])]) == (cleared(7), stored(8, []))
    assert plan_batch(3, [stored(5, [])]) is None  # gap
    assert plan_batch(3, [stored(2, []), stored(3, []), stored(4, [])]) == (stored(4, []),)
    assert plan_batch(3, [stored(3, [])]) == ()  # a duplicate
    assert plan_batch(3, []) == ()
    with pytest.raises(InvalidRequestError, match="grow by 1"):
        plan_batch(3, [stored(4, []), stored(6, [])])


def test_stored_removed_and_leading_prefix(store_url: str | None) -> None:
    prompt = chain(8)

    async def body(store: BaseKVStore) -> None:
        await store.register(worker("d1"), 10_000)
        await store.register(worker("d2"), 10_000)
        await store.register(worker("p1", "prefill"), 10_000)
        assert await counts(store, prompt) == {"d1": 0, "d2": 0, "p1": 0}

        assert not (await store.publish("d1", [cleared(1), stored(2, prompt[:5])])).resync_required
        # d2 holds blocks 0-1 and 3-7: only the two leading ones count.
        r = await store.publish("d2", [cleared(1), stored(2, prompt[:2] + prompt[3:])])
        assert r == (False, 2)
        await store.publish("p1", [cleared(10), stored(11, prompt)])
        matches = await store.lookup_prefix(prompt)
        assert matches == [PrefixMatch("p1", 8), PrefixMatch("d1", 5), PrefixMatch("d2", 2)]
        assert await counts(store, prompt, "decode") == {"d1": 5, "d2": 2}
        assert await counts(store, prompt, "prefill") == {"p1": 8}

        r = await store.publish("d1", [removed(3, [prompt[1]]), stored(4, [prompt[6]])])
        assert r == (False, 2)
        assert (await counts(store, prompt, "decode"))["d1"] == 1
        await store.publish("d1", [stored(5, [prompt[1]])])
        assert (await counts(store, prompt, "decode"))["d1"] == 5
        # Another prompt sharing nothing, an empty one, and one longer than any cache.
        assert await counts(store, chain(4, seed=1)) == {"d1": 0, "d2": 0, "p1": 0}
        assert await counts(store, []) == {"d1": 0, "d2": 0, "p1": 0}
        assert (await counts(store, chain(20)))["p1"] == 8

    run(store_url, body)


def test_gap_asks_for_resync_and_applies_nothing(store_url: str | None) -> None:
    prompt = chain(4)

    async def body(store: BaseKVStore) -> None:
        await store.register(worker("w"), 10_000)
        # Unknown to the index until a CLEARED batch: even a first event is refused.
        assert await store.publish("w", [stored(1, prompt)]) == (True, 0)
        assert await counts(store, prompt) == {"w": 0}
        assert await store.publish("w", [cleared(1), stored(2, prompt[:2])]) == (False, 2)
        assert await store.publish("w", [stored(4, prompt[2:])]) == (True, 0)  # seq 3 missing
        assert await counts(store, prompt) == {"w": 2}
        # The resync protocol: CLEARED, then everything the worker caches.
        assert await store.publish("w", [cleared(5), stored(6, prompt)]) == (False, 2)
        assert await counts(store, prompt) == {"w": 4}
        assert await store.publish("w", [stored(7, [])]) == (False, 1)

    run(store_url, body)


def test_cleared_batch_resets_set_and_baseline(store_url: str | None) -> None:
    prompt = chain(6)

    async def body(store: BaseKVStore) -> None:
        await store.register(worker("w"), 10_000)
        await store.publish("w", [cleared(1), stored(2, prompt)])
        # A restarted worker starts its seqs again, lower than before: CLEARED is accepted.
        assert await store.publish("w", [cleared(1), stored(2, prompt[:1])]) == (False, 2)
        assert await counts(store, prompt) == {"w": 1}
        assert await store.publish("w", [stored(3, prompt[1:3])]) == (False, 1)
        assert await counts(store, prompt) == {"w": 3}
        # CLEARED alone empties the set.
        assert await store.publish("w", [cleared(100)]) == (False, 1)
        assert await counts(store, prompt) == {"w": 0}
        assert await store.publish("w", [stored(101, prompt)]) == (False, 1)
        assert await counts(store, prompt) == {"w": 6}

    run(store_url, body)


def test_duplicates_are_ignored(store_url: str | None) -> None:
    prompt = chain(4)

    async def body(store: BaseKVStore) -> None:
        await store.register(worker("w"), 10_000)
        batch = [cleared(1), stored(2, prompt[:2])]
        await store.publish("w", batch)
        await store.publish("w", [removed(3, [prompt[0]])])
        assert await store.publish("w", [removed(3, [prompt[0]])]) == (False, 0)
        # A retried batch overlapping what was applied: only the new tail applies.
        r = await store.publish("w", [removed(3, [prompt[0]]), stored(4, prompt)])
        assert r == (False, 1)
        assert await counts(store, prompt) == {"w": 4}
        assert await store.publish("w", [stored(4, prompt)]) == (False, 0)

    run(store_url, body)


def test_unregistered_worker_is_refused(store_url: str | None) -> None:
    async def body(store: BaseKVStore) -> None:
        assert await store.publish("ghost", [cleared(1), stored(2, chain(2))]) == (True, 0)
        assert not await store.heartbeat("ghost", WorkerLoad())
        assert await store.lookup_prefix(chain(2)) == []

    run(store_url, body)


def test_directory_roundtrip_and_load(store_url: str | None) -> None:
    info = worker(
        "d1",
        transfer_endpoint="127.0.0.1:7000",
        engine_id="e-1",
        epoch=3,
        transfer_metadata=b"\x00\xffnixl",
        num_blocks=1024,
        block_size=16,
        model="smollm2",
        load=WorkerLoad(1, 2, 0.5, 8),
    )

    async def body(store: BaseKVStore) -> None:
        await store.register(info, 10_000)
        await store.register(worker("p1", "prefill"), 10_000)
        assert await store.list_workers("decode") == [info]
        assert [w.worker_id for w in await store.list_workers()] == ["d1", "p1"]
        assert [w.worker_id for w in await store.list_workers("prefill")] == ["p1"]
        load = WorkerLoad(4, 0, 0.25, 8)
        assert await store.heartbeat("d1", load)
        (got,) = await store.list_workers("decode")
        assert got.load == load and got.transfer_metadata == info.transfer_metadata
        # Re-registering replaces the record and forgets the index.
        await store.publish("d1", [cleared(1), stored(2, chain(2))])
        await store.register(info, 10_000)
        assert await counts(store, chain(2), "decode") == {"d1": 0}
        assert await store.publish("d1", [stored(3, chain(2))]) == (True, 0)

    run(store_url, body)


def test_expiry_and_deregister_remove_workers(store_url: str | None) -> None:
    prompt = chain(3)

    async def body(store: BaseKVStore) -> None:
        for name in ("kept", "expired", "gone"):
            await store.register(worker(name), 300)
            await store.publish(name, [cleared(1), stored(2, prompt)])
        assert await store.deregister("gone")
        assert not await store.deregister("gone")
        assert await counts(store, prompt) == {"kept": 3, "expired": 3}
        for _ in range(5):  # 600 ms: "kept" heartbeats, "expired" does not
            await asyncio.sleep(0.12)
            assert await store.heartbeat("kept", WorkerLoad())
        assert await counts(store, prompt) == {"kept": 3}
        assert [w.worker_id for w in await store.list_workers()] == ["kept"]
        assert not await store.heartbeat("expired", WorkerLoad())
        assert await store.publish("expired", [stored(3, prompt)]) == (True, 0)
        # Coming back: registered again with nothing indexed until it resyncs.
        await store.register(worker("expired"), 300)
        assert await counts(store, prompt) == {"kept": 3, "expired": 0}
        assert await store.publish("expired", [cleared(4), stored(5, prompt[:1])]) == (False, 2)
        assert await counts(store, prompt) == {"kept": 3, "expired": 1}

    run(store_url, body)


def test_bad_input(store_url: str | None) -> None:
    async def body(store: BaseKVStore) -> None:
        with pytest.raises(InvalidRequestError, match="ttl_ms must be positive"):
            await store.register(worker("w"), 0)
        await store.register(worker("w"), 10_000)
        with pytest.raises(InvalidRequestError, match="grow by 1"):
            await store.publish("w", [cleared(1), stored(3, [])])
        assert await counts(store, []) == {"w": 0}

    run(store_url, body)


def test_lookup_of_thousands_of_hashes_is_fast(store_url: str | None) -> None:
    prompt = chain(4000)

    async def body(store: BaseKVStore) -> None:
        for i in range(4):
            await store.register(worker(f"w{i}"), 10_000)
            await store.publish(f"w{i}", [cleared(1), stored(2, prompt[: 1000 * (i + 1) - 1])])
        start = time.perf_counter()
        for _ in range(10):
            matches = await store.lookup_prefix(prompt)
        elapsed = (time.perf_counter() - start) / 10
        assert [m.num_blocks for m in matches] == [3999, 2999, 1999, 999]
        assert elapsed < 0.5, f"a lookup took {elapsed:.3f} s"

    run(store_url, body)


def test_redis_keeps_an_event_log_of_applied_batches(redis_server: Any) -> None:
    prompt = chain(2)

    async def body(store: BaseKVStore) -> None:
        assert isinstance(store, RedisStore)
        await store.register(worker("w"), 10_000)
        await store.publish("w", [stored(1, prompt)])  # refused: not logged
        await store.publish("w", [cleared(1), stored(2, prompt)])
        await store.publish("w", [removed(3, prompt[1:])])
        async with aioredis.Redis.from_url(redis_server.url) as r:
            entries = await r.xrange(store.events_key)
        assert len(entries) == 2
        fields = entries[0][1]
        assert fields[b"worker_id"] == b"w"
        assert (fields[b"first_seq"], fields[b"last_seq"]) == (b"1", b"2")
        assert codec.decode_events(fields[b"events"]) == ("w", [cleared(1), stored(2, prompt)])

    run(redis_server.url, body)


def test_redis_outage_and_restart(redis_server: Any) -> None:
    prompt = chain(2)

    async def body(store: BaseKVStore) -> None:
        await store.register(worker("w"), 10_000)
        await store.publish("w", [cleared(1), stored(2, prompt)])
        redis_server.stop()
        for call in (
            store.ping(),
            store.heartbeat("w", WorkerLoad()),
            store.list_workers(),
            store.lookup_prefix(prompt),
            store.publish("w", [stored(3, prompt)]),
            store.register(worker("w"), 10_000),
        ):
            with pytest.raises(StoreUnavailableError, match="unavailable"):
                await call
        redis_server.start()  # empty, as after a crash
        await store.ping()
        assert not await store.heartbeat("w", WorkerLoad())
        assert await store.publish("w", [stored(3, prompt)]) == (True, 0)
        assert await store.lookup_prefix(prompt) == []
        await store.register(worker("w"), 10_000)
        assert await store.publish("w", [cleared(4), stored(5, prompt)]) == (False, 2)
        assert await counts(store, prompt) == {"w": 2}

    run(redis_server.url, body)


def test_codec_validates_requests() -> None:
    from baton.v1 import kvstore_pb2

    info = worker("w", num_blocks=4, transfer_metadata=b"m")
    request = codec.register_request(info, 500)
    assert codec.register_from_proto(request) == (info, 500)
    bad = [
        (codec.register_request(info, 0), "ttl_ms must be positive"),
        (codec.register_request(worker(""), 500), "worker_id must not be empty"),
        (codec.register_request(worker("w", num_blocks=-1), 500), "num_blocks"),
    ]
    for pb, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            codec.register_from_proto(pb)
    no_role = kvstore_pb2.RegisterWorkerRequest(
        worker=kvstore_pb2.WorkerInfo(worker_id="w", grpc_address="x:1"), ttl_ms=5
    )
    with pytest.raises(InvalidRequestError, match="role must be PREFILL or DECODE"):
        codec.register_from_proto(no_role)
    events = [cleared(1), stored(2, chain(2)), removed(3, chain(1))]
    assert codec.publish_from_proto(codec.publish_request("w", events)) == ("w", events)
    unspecified = kvstore_pb2.PublishKVEventsRequest(
        worker_id="w", events=[kvstore_pb2.KVEvent(seq=1)]
    )
    with pytest.raises(InvalidRequestError, match="event kind"):
        codec.publish_from_proto(unspecified)
    with pytest.raises(InvalidRequestError, match="block hash must be"):
        codec.lookup_from_proto(codec.lookup_request([b""], None))
