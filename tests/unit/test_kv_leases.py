"""LeaseTable: grant, extend, release, expiry and aborts with an injected clock."""

from __future__ import annotations

import asyncio

import pytest

from baton_kvtransfer.errors import LeaseUnavailableError
from baton_kvtransfer.leases import FreeReason, LeaseTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_table(ttl_s: float = 10.0) -> tuple[LeaseTable, FakeClock, list[tuple[str, str]]]:
    clock = FakeClock()
    freed: list[tuple[str, str]] = []

    def on_free(req_id: str, reason: FreeReason) -> None:
        freed.append((req_id, reason))

    table = LeaseTable(on_free, default_ttl_s=ttl_s, clock=clock, wall_clock=lambda: 5000.0)
    return table, clock, freed


def test_grant_and_check() -> None:
    table, _, freed = make_table()
    lease = table.grant("r1", [3, 4, 9])
    assert len(lease.lease_id) == 32 and int(lease.lease_id, 16) >= 0
    assert lease.req_id == "r1" and lease.block_ids == (3, 4, 9)
    assert lease.expiry == 1010.0
    assert lease.expiry_unix_ms == 5_010_000
    assert table.num_active == 1
    assert table.check(lease.lease_id, [9, 3]) == lease
    assert table.check(lease.lease_id) == lease
    assert table.grant("r2", [1], ttl_s=2.5).expiry == 1002.5
    table.check_invariants()
    assert freed == []


def test_check_rejects_foreign_blocks_and_unknown_leases() -> None:
    table, _, freed = make_table()
    lease = table.grant("r1", [3, 4])
    with pytest.raises(LeaseUnavailableError, match="does not cover blocks \\[5\\]"):
        table.check(lease.lease_id, [3, 5])
    with pytest.raises(LeaseUnavailableError, match="unknown"):
        table.check("nope", [])
    assert table.num_active == 1 and freed == []  # a bad check frees nothing


def test_extend_never_shortens() -> None:
    table, clock, _ = make_table(ttl_s=10.0)
    lease = table.grant("r1", [1])
    clock.now += 8.0
    extended = table.extend(lease.lease_id, 5_000)
    assert extended.expiry == 1013.0 and extended.expiry_unix_ms == 5_005_000
    assert table.extend(lease.lease_id, 1_000).expiry == 1013.0
    clock.now += 4.9
    assert table.check(lease.lease_id).lease_id == lease.lease_id
    with pytest.raises(LeaseUnavailableError):
        table.extend("unknown", 1_000)


def test_release_frees_once() -> None:
    table, _, freed = make_table()
    lease = table.grant("r1", [1, 2])
    assert table.release(lease.lease_id) is True
    assert table.release(lease.lease_id) is False
    assert freed == [("r1", "released")]
    assert table.num_active == 0 and table.num_released_total == 1
    with pytest.raises(LeaseUnavailableError):
        table.check(lease.lease_id, [1])
    with pytest.raises(LeaseUnavailableError):
        table.extend(lease.lease_id, 1000)
    table.check_invariants()


def test_expiry_by_sweep() -> None:
    table, clock, freed = make_table(ttl_s=10.0)
    a = table.grant("a", [1])
    b = table.grant("b", [2], ttl_s=20.0)
    clock.now += 9.999
    assert table.expire_due() == []
    clock.now += 0.001
    assert table.expire_due() == [a.lease_id]
    assert freed == [("a", "expired")]
    assert table.release(a.lease_id) is False  # release after expiry
    assert table.expire_due(now=clock.now + 10.0) == [b.lease_id]
    assert freed == [("a", "expired"), ("b", "expired")]
    assert table.num_expired_total == 2 and table.num_released_total == 0
    table.check_invariants()


def test_expired_lease_is_freed_when_touched_before_the_sweep() -> None:
    table, clock, freed = make_table(ttl_s=1.0)
    a = table.grant("a", [1])
    b = table.grant("b", [2])
    c = table.grant("c", [3])
    clock.now += 1.0
    assert table.release(a.lease_id) is False
    with pytest.raises(LeaseUnavailableError):
        table.check(b.lease_id, [2])
    with pytest.raises(LeaseUnavailableError):
        table.extend(c.lease_id, 10_000)  # too late to extend
    assert freed == [("a", "expired"), ("b", "expired"), ("c", "expired")]
    assert table.expire_due() == []  # each freed exactly once
    assert table.num_active == 0


def test_release_request_aborts_all_its_leases() -> None:
    table, _, freed = make_table()
    a1 = table.grant("a", [1])
    a2 = table.grant("a", [2])
    b = table.grant("b", [3])
    assert table.release_request("a") is True
    assert table.release_request("a") is False
    assert table.release_request("unknown") is False
    assert sorted(freed) == [("a", "aborted"), ("a", "aborted")]
    assert table.release(a1.lease_id) is False and table.release(a2.lease_id) is False
    assert table.release(b.lease_id) is True
    assert table.num_aborted_total == 2 and table.num_released_total == 1
    table.check_invariants()


def test_on_free_failure_does_not_keep_the_lease() -> None:
    calls: list[str] = []

    def on_free(req_id: str, reason: FreeReason) -> None:
        calls.append(req_id)
        raise RuntimeError("owner bug")

    table = LeaseTable(on_free)
    lease = table.grant("r", [1])
    assert table.release(lease.lease_id) is True
    assert table.release(lease.lease_id) is False
    assert calls == ["r"] and table.num_active == 0


def test_bad_ttl() -> None:
    table, _, _ = make_table()
    with pytest.raises(ValueError):
        table.grant("r", [1], ttl_s=0)
    with pytest.raises(ValueError):
        LeaseTable(lambda r, why: None, default_ttl_s=-1)


def test_run_expires_in_the_background() -> None:
    freed: list[tuple[str, str]] = []

    async def main() -> None:
        table = LeaseTable(lambda r, why: freed.append((r, why)), default_ttl_s=0.05)
        table.grant("r", [1])
        task = asyncio.create_task(table.run(0.01))
        try:
            for _ in range(200):
                if freed:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert table.num_active == 0

    asyncio.run(main())
    assert freed == [("r", "expired")]
