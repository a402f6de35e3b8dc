"""A worker's Prometheus metrics: vLLM's names and buckets under ``baton:`` or, with
``--metric-names vllm``, ``vllm:``; counters advance by the engine's deltas; finished requests
count their prompt and generated tokens in vLLM's 1-2-5 buckets."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton_decode.metrics import StatsLogger, WorkerMetrics, token_buckets
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
    metrics.record_stats(EngineStats(2, 1, 0.25, 10, 4, 0, 30, 7, num_host_queries=10))
    host = {"num_host_queries": 22, "num_host_hits": 6}  # (the host KV tier's)
    metrics.record_stats(EngineStats(1, 0, 0.5, 12, 4, 1, 40, 9, **host))
    metrics.record_finished("stop", num_prompt_tokens=30, num_generated=7)
    metrics.record_finished("length", num_prompt_tokens=3, num_generated=1)
    metrics.record_finished("abort", num_prompt_tokens=99, num_generated=99)  # not counted
    got = samples(metrics)
    m = (("model_name", "m"),)
    assert got[(f"{prefix}:num_requests_running", m)] == 1
    assert got[(f"{prefix}:kv_cache_usage_perc", m)] == 0.5
    assert got[(f"{prefix}:generation_tokens_total", m)] == 9
    assert got[(f"{prefix}:external_prefix_cache_queries_total", m)] == 22
    assert got[(f"{prefix}:external_prefix_cache_hits_total", m)] == 6
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


def test_speculative_decodings_counters_as_vllms() -> None:
    metrics = WorkerMetrics("m", metric_names="vllm")
    metrics.record_stats(EngineStats(1, 0, 0.1, 0, 0, 0, 5, 9, 3, 9, 4, (3, 1, 0)))
    metrics.record_stats(EngineStats(1, 0, 0.1, 0, 0, 0, 5, 20, 5, 15, 7, (5, 2, 0)))
    got = samples(metrics)
    m = (("model_name", "m"),)
    assert got[("vllm:spec_decode_num_drafts_total", m)] == 5
    assert got[("vllm:spec_decode_num_draft_tokens_total", m)] == 15
    assert got[("vllm:spec_decode_num_accepted_tokens_total", m)] == 7
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [got.get((per_pos, (*m, ("position", str(i))))) for i in range(3)] == [5, 2, None]


def test_the_log_line_of_a_window_with_drafts(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's "SpecDecoding metrics" line, for the window's drafts only; none without drafts."""
    start = EngineStats(1, 0, 0.1, 0, 0, 0, 5, 9, 3, 9, 4, (3, 1, 0))
    log = StatsLogger(start, interval_s=1.0)
    with caplog.at_level("INFO", logger="baton_decode.metrics"):
        log.maybe_log(start, now=0.0)  # opens the window
        log.maybe_log(EngineStats(1, 0, 0.1, 0, 0, 0, 5, 20, 7, 21, 10, (7, 3, 0)), now=1.0)
        log.maybe_log(EngineStats(1, 0, 0.1, 0, 0, 0, 5, 30, 7, 21, 10, (7, 3, 0)), now=2.0)
    lines = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert lines == [
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted: 6 tokens, Drafted: 12 "
        "tokens, Per-position acceptance rate: 1.000, 0.500, 0.000, Avg Draft acceptance "
        "rate: 50.0%"
    ]


def test_the_log_line_names_the_host_tiers_hit_rate(caplog: pytest.LogCaptureFixture) -> None:
    """With a host KV tier, vLLM's line with a KV connector: the external hit rate too."""
    start = EngineStats(1, 0, 0.1, 0, 0, 0, 5, 9)
    log = StatsLogger(start, interval_s=1.0)
    with caplog.at_level("INFO", logger="baton_decode.metrics"):
        log.maybe_log(start, now=0.0)
        log.maybe_log(EngineStats(1, 0, 0.1, 100, 40, 0, 105, 9), now=1.0)
        tier = {"num_host_queries": 100, "num_host_hits": 25}
        log.maybe_log(EngineStats(1, 0, 0.1, 200, 40, 0, 205, 9, **tier), now=2.0)
    lines = [r.getMessage() for r in caplog.records if "Prefix cache" in r.getMessage()]
    assert len(lines) == 2
    assert lines[0].endswith("Prefix cache hit rate: 40.0%")
    assert lines[1].endswith("Prefix cache hit rate: 20.0%, External prefix cache hit rate: 25.0%")


def test_inter_token_latency_under_both_of_vllms_names() -> None:
    metrics = WorkerMetrics("m", metric_names="vllm")
    metrics.record_inter_token(0.03)
    got = samples(metrics)
    m = (("model_name", "m"),)
    assert got[("vllm:inter_token_latency_seconds_count", m)] == 1
    assert got[("vllm:time_per_output_token_seconds_count", m)] == 1
    assert got[("vllm:time_per_output_token_seconds_sum", m)] == pytest.approx(0.03)


def test_a_finished_requests_phases_and_the_steps_tokens() -> None:
    """vLLM's request phases (queued, prefill, decode, inference; the per-request time per
    output token), tokens per forward pass and max_tokens, which its dashboard plots."""
    metrics = WorkerMetrics("m", metric_names="vllm", max_model_len=512)
    metrics.record_request_times(10.0, scheduled=10.5, first_token=11.0, last_token=14.0,
                                 num_generated=7)  # fmt: skip
    metrics.record_request_times(20.0, scheduled=20.0, first_token=22.0, last_token=22.0,
                                 num_generated=1)  # fmt: skip
    metrics.record_step(300)
    metrics.record_step(4, num_passes=3)  # a multi-step: three passes of 4 decodes
    metrics.record_finished("length", 3, 7, max_tokens=7)
    metrics.record_finished("abort", 3, 1, max_tokens=100)  # not counted
    got = samples(metrics)
    m = (("model_name", "m"),)
    sums = {
        "request_queue_time_seconds": 0.5,
        "request_prefill_time_seconds": 0.5 + 2.0,
        "request_decode_time_seconds": 3.0,
        "request_inference_time_seconds": 3.5 + 2.0,
    }
    for name, total in sums.items():
        assert got[(f"vllm:{name}_count", m)] == 2, name
        assert got[(f"vllm:{name}_sum", m)] == pytest.approx(total), name
    tpot = "vllm:request_time_per_output_token_seconds"
    assert got[(f"{tpot}_count", m)] == 1  # (one token has no time per output token)
    assert got[(f"{tpot}_sum", m)] == pytest.approx(0.5)
    steps = "vllm:iteration_tokens_total"
    assert got[(f"{steps}_count", m)] == 4
    assert got[(f"{steps}_bucket", (("le", "8.0"), *m))] == 3
    assert got[(f"{steps}_bucket", (("le", "256.0"), *m))] == 3
    assert got[(f"{steps}_bucket", (("le", "512.0"), *m))] == 4
    assert got[("vllm:request_params_max_tokens_count", m)] == 1
    assert got[("vllm:request_params_max_tokens_sum", m)] == 7


def test_cache_config_and_lora_adapters_info() -> None:
    """vLLM's info gauges: the KV cache's settings (load balancers size a worker by
    num_gpu_blocks x block_size) and, with LoRA, the adapters in use (the Gateway API
    Inference Extension's endpoint picker routes by them: the latest sample, by value)."""
    cache = {"block_size": 16, "num_gpu_blocks": 100, "enable_prefix_caching": True}
    metrics = WorkerMetrics("m", metric_names="vllm", cache_config=cache, max_loras=2)
    got = samples(metrics)
    labels = (("block_size", "16"), ("enable_prefix_caching", "True"), ("num_gpu_blocks", "100"))
    assert got[("vllm:cache_config_info", labels)] == 1

    def lora_info() -> dict[tuple[tuple[str, str], ...], float]:
        return {k[1]: v for k, v in samples(metrics).items() if k[0] == "vllm:lora_requests_info"}

    def keys(running: str, waiting: str) -> tuple[tuple[str, str], ...]:
        return (
            ("max_lora", "2"),
            ("running_lora_adapters", running),
            ("waiting_lora_adapters", waiting),
        )

    assert list(lora_info()) == [keys("", "")]
    before = time.time()
    metrics.record_lora_adapters(["a", "b"], ["c"])
    info = lora_info()
    assert list(info) == [keys("a,b", "c")]  # (the previous sample is gone)
    assert before <= info[keys("a,b", "c")] <= time.time()
    # Without LoRA there is no such gauge (as in vLLM).
    plain = samples(WorkerMetrics("m", metric_names="vllm"))
    assert not any(name == "vllm:lora_requests_info" for name, _ in plain)
    assert not any(name == "vllm:cache_config_info" for name, _ in plain)


def test_the_sleep_state_is_vllms_gauge() -> None:
    """``engine_sleep_state`` (vLLM's, under ``--metric-names vllm``): 1 for the state the
    engine is in (awake at start; level 1 offloads the weights, level 2 discards all)."""
    metrics = WorkerMetrics("m", metric_names="vllm")

    def states() -> dict[str, float]:
        return {
            dict(labels)["sleep_state"]: value
            for (name, labels), value in samples(metrics).items()
            if name == "vllm:engine_sleep_state"
        }

    assert states() == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    metrics.record_sleep_level(2)
    assert states() == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
    metrics.record_sleep_level(0)
    assert states()["awake"] == 1.0
