"""The gateway's view of a worker's prefill queue (``PrefillBacklog``): the speed it learns
from completed prompts and the wait it predicts for the next one."""

from __future__ import annotations

import pytest

from baton_gateway.client import PrefillBacklog


def test_the_speed_is_unknown_until_a_prompt_completes() -> None:
    b = PrefillBacklog()
    b.add(1000, now=0.0)
    assert b.tokens_per_s() is None
    assert b.wait_s() == 0.0  # unknown: never a reason to go elsewhere


def test_the_speed_counts_only_the_time_with_tokens_pending() -> None:
    b = PrefillBacklog()
    b.add(1000, now=0.0)
    b.remove(1000, now=0.5, completed=True)  # 1000 tokens in 0.5 s
    b.add(2000, now=10.0)  # idle in between: not counted
    b.remove(2000, now=11.0, completed=True)
    assert b.tokens_per_s() == pytest.approx(3000 / 1.5, rel=0.05)
    b.add(4000, now=20.0)
    assert b.pending == 4000
    assert b.wait_s() == pytest.approx(4000 / b.tokens_per_s())  # type: ignore[operator]


def test_prompts_given_up_leave_the_queue_but_teach_no_speed() -> None:
    b = PrefillBacklog()
    b.add(500, now=0.0)
    b.remove(500, now=0.1, completed=True)
    speed = b.tokens_per_s()
    b.add(800, now=1.0)
    b.remove(800, now=5.0, completed=False)  # failed after 4 s: no evidence of the speed
    assert b.pending == 0
    assert b.tokens_per_s() == speed


def test_recent_completions_weigh_more() -> None:
    b = PrefillBacklog()
    for i in range(30):  # slow at first: 1000 tokens/s
        b.add(1000, now=float(i))
        b.remove(1000, now=i + 1.0, completed=True)
    for i in range(60):  # then fast: 10,000 tokens/s
        t = 100.0 + i
        b.add(1000, now=t)
        b.remove(1000, now=t + 0.1, completed=True)
    assert b.tokens_per_s() == pytest.approx(10_000, rel=0.1)
