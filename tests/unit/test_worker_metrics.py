"""A worker's Prometheus metrics: vLLM's names and buckets under ``baton:`` or, with
``--metric-names vllm``, ``vllm:``; counters advance by the engine's deltas; finished requests
count their prompt and generated tokens in vLLM's 1-2-5 buckets."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton_decode.metrics import WorkerMetrics, token_buckets
from baton_engine.core.engine_core import EngineStats


def samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_token_buckets_are_vllms() -> None:
    assert token_buckets(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


@pytest.mark.parametrize("prefix", ["baton", "vllm"])
def test_metrics_under_either_prefix(prefix: str) -> None:
    metrics = WorkerMetrics("m", metric_names=prefix, max_model_len=512)
    metrics.record_stats(EngineStats(2, 1, 0.25, 10, 4, 0, 30, 7))
    metrics.record_stats(EngineStats(1, 0, 0.5, 12, 4, 1, 40, 9))
    metrics.record_finished("stop", num_prompt_tokens=30, num_generated=7)
    metrics.record_finished("length", num_prompt_tokens=3, num_generated=1)
    metrics.record_finished("abort", num_prompt_tokens=99, num_generated=99)  # not counted
    got = samples(metrics)
    m = (("model_name", "m"),)
    assert got[(f"{prefix}:num_requests_running", m)] == 1
    assert got[(f"{prefix}:kv_cache_usage_perc", m)] == 0.5
    assert got[(f"{prefix}:generation_tokens_total", m)] == 9
    assert got[(f"{prefix}:request_prompt_tokens_count", m)] == 2
    assert got[(f"{prefix}:request_prompt_tokens_sum", m)] == 33
    assert got[(f"{prefix}:request_generation_tokens_sum", m)] == 8
    assert got[(f"{prefix}:request_generation_tokens_bucket", (("le", "5.0"), *m))] == 1
    assert got[(f"{prefix}:request_generation_tokens_bucket", (("le", "10.0"), *m))] == 2
    stops = (("finished_reason", "abort"), *m)
    assert got[(f"{prefix}:request_success_total", stops)] == 1
    # Disaggregation's own metrics keep Baton's names either way.
    assert ("baton:kv_transfer_bytes_total", m) in got
    other = "vllm" if prefix == "baton" else "baton"
    assert not any(name.startswith(f"{other}:num_requests") for name, _ in got)
    # vLLM's older names of the same series, under vllm: only
    old = {
        ("vllm:gpu_cache_usage_perc", m): 0.5,
        ("vllm:gpu_prefix_cache_queries_total", m): 12,
        ("vllm:gpu_prefix_cache_hits_total", m): 4,
    }
    assert all((got.get(k) == v) == (prefix == "vllm") for k, v in old.items())


def test_inter_token_latency_under_both_of_vllms_names() -> None:
    metrics = WorkerMetrics("m", metric_names="vllm")
    metrics.record_inter_token(0.03)
    got = samples(metrics)
    m = (("model_name", "m"),)
    assert got[("vllm:inter_token_latency_seconds_count", m)] == 1
    assert got[("vllm:time_per_output_token_seconds_count", m)] == 1
    assert got[("vllm:time_per_output_token_seconds_sum", m)] == pytest.approx(0.03)
