"""How an engine on a GPU sizes its KV pool: its own share of the device, whatever other
processes on the device hold (``kv_budget_bytes``)."""

from __future__ import annotations

from baton_engine.core.engine_core import kv_budget_bytes

GIB = 1 << 30


def test_alone_the_share_less_weights_and_peak() -> None:
    # 100 GiB device, 1 GiB of context at start, 20 GiB of weights loaded, 5 GiB peak
    assert kv_budget_bytes(100 * GIB, 0.9, 99 * GIB, 79 * GIB, 5 * GIB) == 65 * GIB


def test_what_other_processes_hold_does_not_count() -> None:
    """A second worker on the GPU (the first holds 45 GiB) gets the same pool as the first."""
    first = kv_budget_bytes(100 * GIB, 0.45, 99 * GIB, 79 * GIB, 5 * GIB)
    second = kv_budget_bytes(100 * GIB, 0.45, 54 * GIB, 34 * GIB, 5 * GIB)
    assert first == second == 20 * GIB


def test_never_more_than_is_free_and_never_negative() -> None:
    # the whole device asked for: the context held at start is not free
    assert kv_budget_bytes(100 * GIB, 1.0, 99 * GIB, 79 * GIB, 5 * GIB) == 74 * GIB
    # weights and peak exceed the share
    assert kv_budget_bytes(100 * GIB, 0.1, 99 * GIB, 79 * GIB, 5 * GIB) == 0
