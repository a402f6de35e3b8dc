"""``baton bench serve``'s request bodies and arrival schedule (pure functions). The client's
timing, failure recording and reports run against the real server in
tests/integration/test_bench_serve.py."""

from __future__ import annotations

import pytest

from baton.bench import runner
from baton.bench.client import RequestConfig, build_payload
from baton.bench.datasets import SampleRequest


def test_payloads() -> None:
    cfg = RequestConfig("u", "m", chat=False, ignore_eos=True, timeout_s=1.0)
    body = build_payload(cfg, SampleRequest("hi", 1, 7))
    assert body == {
        "model": "m",
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": "hi",
        "max_tokens": 7,
        "ignore_eos": True,
    }
    chat = RequestConfig("u", "m", chat=True, ignore_eos=False, timeout_s=1.0)
    body = build_payload(chat, SampleRequest("hi", 1, 7))
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_completion_tokens"] == 7 and "ignore_eos" not in body
    assert not {"top_p", "top_k", "min_p"} & body.keys()  # sent only when asked for
    sampled = RequestConfig("u", "m", False, False, 1.0, temperature=1.0, top_p=0.9, top_k=50)
    body = build_payload(sampled, SampleRequest("hi", 1, 7))
    assert (body["temperature"], body["top_p"], body["top_k"]) == (1.0, 0.9, 50)
    assert "min_p" not in body


def test_arrival_gaps() -> None:
    assert runner.arrival_gaps(5, float("inf"), 1.0, 0) == [0.0] * 5
    gaps = runner.arrival_gaps(4001, 20.0, 1.0, 0)
    assert gaps[-1] == 0.0 and all(g > 0 for g in gaps[:-1])
    assert sum(gaps) / 4000 == pytest.approx(1 / 20.0, rel=0.1)
    assert runner.arrival_gaps(10, 5.0, 2.0, 3) == runner.arrival_gaps(10, 5.0, 2.0, 3)
