"""Worker metrics relabelled by worker, and the gateway's own request metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton_gateway.metrics import GatewayMetrics, parse_metrics, relabel, render


def _worker_text(running: int, tokens: int) -> str:
    r = CollectorRegistry()
    Gauge("baton:num_requests_running", "Requests", ["model_name"], registry=r).labels("m").set(
        running
    )
    Counter("baton:generation_tokens", "Tokens", ["model_name"], registry=r).labels("m").inc(tokens)
    Histogram("baton:e2e_request_latency_seconds", "E2E", ["model_name"], buckets=(1.0,),
              registry=r).labels("m").observe(0.5)  # fmt: skip
    return generate_latest(r).decode()


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_relabel_merges_workers_into_one_family_each() -> None:
    merged = relabel(
        {"w1:1": parse_metrics(_worker_text(2, 10)), "w2:2": parse_metrics(_worker_text(3, 7))}
    )
    text = render(merged).decode()
    # One HELP/TYPE block per family, however many workers.
    assert text.count("# TYPE baton:num_requests_running gauge") == 1
    assert text.count("# TYPE baton:generation_tokens_total counter") == 1
    samples = _samples(text)
    w1 = frozenset({("model_name", "m"), ("worker", "w1:1")})
    w2 = frozenset({("model_name", "m"), ("worker", "w2:2")})
    assert samples[("baton:num_requests_running", w1)] == 2
    assert samples[("baton:num_requests_running", w2)] == 3
    assert samples[("baton:generation_tokens_total", w2)] == 7
    assert samples[("baton:e2e_request_latency_seconds_count", w1)] == 1
    assert all(dict(labels).get("worker") for _, labels in samples)
    # `grep num_requests` finds each worker's line.
    lines = [line for line in text.splitlines() if line.startswith("baton:num_requests_running")]
    assert len(lines) == 2 and all('worker="' in line for line in lines)


def test_relabel_overrides_a_worker_label() -> None:
    text = 'x{worker="self"} 1\n'
    merged = relabel({"w:1": parse_metrics(text)})
    assert 'worker="w:1"' in render(merged).decode()


def test_gateway_metrics_record_each_request_once() -> None:
    metrics = GatewayMetrics("m")
    record = metrics.start("chat")
    running = _samples(generate_latest(metrics.registry).decode())
    assert running[("baton:gateway_num_requests_running", frozenset({("model_name", "m")}))] == 1
    metrics.finish(
        record,
        "ok",
        first_token_time=record.arrival + 0.05,
        num_prompt_tokens=5,
        num_generation_tokens=3,
    )
    metrics.finish(record, "ok", num_prompt_tokens=5)  # ignored: already recorded
    samples = _samples(generate_latest(metrics.registry).decode())
    m = frozenset({("model_name", "m")})
    assert samples[("baton:gateway_num_requests_running", m)] == 0
    key = frozenset({("model_name", "m"), ("endpoint", "chat"), ("status", "ok")})
    assert samples[("baton:gateway_requests_total", key)] == 1
    assert samples[("baton:gateway_prompt_tokens_total", m)] == 5
    assert samples[("baton:gateway_generation_tokens_total", m)] == 3
    assert samples[("baton:gateway_time_to_first_token_seconds_count", m)] == 1
    assert samples[("baton:gateway_e2e_request_latency_seconds_count", m)] == 1


def test_relabel_adds_the_role_of_each_worker() -> None:
    merged = relabel(
        {"p:1": parse_metrics(_worker_text(1, 5)), "d:2": parse_metrics(_worker_text(4, 9))},
        {"p:1": "prefill", "d:2": "decode"},
    )
    samples = _samples(render(merged).decode())
    prefill = frozenset({("model_name", "m"), ("worker", "p:1"), ("role", "prefill")})
    decode = frozenset({("model_name", "m"), ("worker", "d:2"), ("role", "decode")})
    assert samples[("baton:num_requests_running", prefill)] == 1
    assert samples[("baton:num_requests_running", decode)] == 4
