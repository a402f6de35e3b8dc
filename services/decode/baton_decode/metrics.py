"""Prometheus metrics (vLLM's names and buckets, ``baton:`` prefix, or ``vllm:`` with
``--metric-names vllm`` so that dashboards and autoscalers built for vLLM read them
unchanged) and the periodic stats log line. Disaggregation's own metrics (KV transfer, leases)
have no vLLM counterpart and keep ``baton:``.

Engine-wide counters are fed from ``EngineCore.stats()`` deltas by the engine thread; per-request
latencies are observed on the asyncio loop when outputs are delivered, so they are what the worker
itself measured (arrival at ``Generate`` to token delivery), not what a client sees.
``prometheus_client`` is thread-safe, so both threads may record.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton_engine.core.engine_core import EngineStats

logger = logging.getLogger(__name__)

# vLLM's buckets, so dashboards built for vLLM read these unchanged.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

_ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                      8192.0, 16384.0)  # fmt: skip


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's buckets of per-request token counts: 1, 2, 5, 10, 20, 50, ... up to
    ``max_model_len``."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vLLM's, by sleep level


class WorkerMetrics:
    """One worker's metrics in its own registry (several workers may share a process in tests).

    Every metric carries a ``model_name`` label. Counters only move forward: ``record_stats``
    adds the difference to the previous snapshot and ignores decreases.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        metric_names: str = "baton",
        max_model_len: int = 8192,
        cache_config: Mapping[str, object] | None = None,
        max_loras: int | None = None,
    ) -> None:
        """``metric_names``: the engine metrics' prefix, one of
        ``vllm_flags.METRIC_PREFIXES``; ``max_model_len`` bounds the token-count buckets.
        ``cache_config``: the KV cache's settings, exported as the labels of
        ``cache_config_info`` (as vLLM's: load balancers read ``num_gpu_blocks`` and
        ``block_size`` there); ``max_loras``: set when LoRA is enabled, to export
        ``lora_requests_info`` (which the Gateway API Inference Extension's endpoint picker reads
        for its LoRA affinity)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        prefix = metric_names

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{prefix}:{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"{prefix}:{name}", doc, labels, buckets=buckets, registry=self.registry
            )

        m = model_name
        self.num_requests_running = gauge("num_requests_running", "Requests in the batch").labels(m)
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests queued").labels(m)
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV blocks in use, 0..1").labels(m)
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        ).labels(m)
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache"
        ).labels(m)
        # the host KV tier (--kv-offloading-size), as vLLM's KV connectors' external_* series
        self.external_prefix_cache_queries = counter(
            "external_prefix_cache_queries", "Prompt tokens looked up in the host KV tier"
        ).labels(m)
        self.external_prefix_cache_hits = counter(
            "external_prefix_cache_hits", "Prompt tokens found in the host KV tier"
        ).labels(m)
        self.num_preemptions = counter("num_preemptions", "Preemptions (recompute)").labels(m)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received").labels(m)
        self.generation_tokens = counter("generation_tokens", "Tokens generated").labels(m)
        # speculative decoding (--speculative-config), as vLLM's spec_decode_* series
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Steps of a request with drafts"
        ).labels(m)
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed"
        ).labels(m)
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted"
        ).labels(m)
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a step's drafts",
            ["model_name", "position"],
            registry=self.registry,
        )
        self.request_success = Counter(
            f"{prefix}:request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token", _TTFT_BUCKETS
        ).labels(m)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens", _ITL_BUCKETS
        ).labels(m)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last token", _E2E_BUCKETS
        ).labels(m)
        # A finished request's phases, as vLLM splits them: queued (arrival to first
        # scheduled), prefill (to first token), decode (to last token); inference is the last
        # two.
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled", _E2E_BUCKETS
        ).labels(m)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token", _E2E_BUCKETS
        ).labels(m)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token", _E2E_BUCKETS
        ).labels(m)
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token", _E2E_BUCKETS
        ).labels(m)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Of each request, its decode time over the tokens after the first",
            _ITL_BUCKETS,
        ).labels(m)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed by each forward pass", _ITERATION_BUCKETS
        ).labels(m)
        tokens = token_buckets(max_model_len)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "max_tokens of each finished request", tokens
        ).labels(m)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request", tokens
        ).labels(m)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated by each finished request", tokens
        ).labels(m)
        if cache_config is not None:
            info = {k: str(v) for k, v in cache_config.items()}
            Gauge(
                f"{prefix}:cache_config_info", "The KV cache's settings", list(info),
                registry=self.registry,
            ).labels(**info).set(1)  # fmt: skip
        self._lora_info: Gauge | None = None
        self._lora_labels: tuple[str, str, str] | None = None
        self._max_loras = str(max_loras)
        if max_loras is not None:
            self._lora_info = Gauge(
                f"{prefix}:lora_requests_info",
                "LoRA adapters in use (labels); the value is when it was last updated",
                ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                registry=self.registry,
            )
            self.record_lora_adapters([], [])
        # vLLM's sleep mode: 1 for the state the engine is in, 0 for the others
        self._sleep_state = Gauge(
            f"{prefix}:engine_sleep_state",
            "Sleep mode: 1 for the engine's state (awake; weights_offloaded: level 1; "
            "discard_all: level 2)",
            ["model_name", "sleep_state"],
            registry=self.registry,
        )
        self.record_sleep_level(0)
        # Disaggregation: KV pulled (decode side) and leases held (prefill side); Baton's own.
        prefix = "baton"
        self.kv_transfer_seconds = histogram(
            "kv_transfer_seconds", "Time to pull one request's missing KV blocks", _ITL_BUCKETS
        ).labels(m)
        self.kv_transfer_read_seconds = histogram(
            "kv_transfer_read_seconds",
            "Of a pull, the time moving the bytes (without the lease RPCs around it)",
            _ITL_BUCKETS,
        ).labels(m)
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "KV bytes pulled").labels(m)
        self.kv_transfer_blocks = counter("kv_transfer_blocks", "KV blocks pulled").labels(m)
        self.kv_transfer_failures = counter(
            "kv_transfer_failures", "KV pulls that failed (the prompt was recomputed or failed)"
        ).labels(m)
        self.kv_lease_expired = counter(
            "kv_lease_expired", "Leases on prefilled KV that expired before release"
        ).labels(m)
        self.kv_leases_active = gauge("kv_leases_active", "Prefilled prompts held").labels(m)
        # vLLM's older names of the same series (dashboards and autoscalers written for vLLM
        # before 0.10/0.11 read these), under vllm: only.
        self._old_kv_usage: Gauge | None = None
        self._old_itl: Histogram | None = None
        self._old_prefix: tuple[Counter, Counter] | None = None
        if metric_names == "vllm":
            prefix = "vllm"
            self._old_kv_usage = gauge("gpu_cache_usage_perc", "As kv_cache_usage_perc").labels(m)
            self._old_itl = histogram(
                "time_per_output_token_seconds", "As inter_token_latency_seconds", _ITL_BUCKETS
            ).labels(m)
            self._old_prefix = (
                counter("gpu_prefix_cache_queries", "As prefix_cache_queries").labels(m),
                counter("gpu_prefix_cache_hits", "As prefix_cache_hits").labels(m),
            )
        # The engine's counters start at zero, as ours do.
        self._last = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)

    def record_stats(self, stats: EngineStats) -> None:
        """Set the gauges and advance the counters by the change since the last call."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        if self._old_kv_usage is not None:
            self._old_kv_usage.set(stats.kv_cache_usage)
        last = self._last
        if self._old_prefix is not None:
            for counter, now, before in zip(
                self._old_prefix,
                (stats.num_prefix_queries, stats.num_prefix_hits),
                (last.num_prefix_queries, last.num_prefix_hits),
                strict=True,
            ):
                if now > before:
                    counter.inc(now - before)
        for counter, now, before in (
            (self.prefix_cache_queries, stats.num_prefix_queries, last.num_prefix_queries),
            (self.prefix_cache_hits, stats.num_prefix_hits, last.num_prefix_hits),
            (
                self.external_prefix_cache_queries,
                stats.num_host_queries,
                last.num_host_queries,
            ),
            (self.external_prefix_cache_hits, stats.num_host_hits, last.num_host_hits),
            (self.num_preemptions, stats.num_preemptions, last.num_preemptions),
            (self.prompt_tokens, stats.num_prompt_tokens, last.num_prompt_tokens),
            (self.generation_tokens, stats.num_generated_tokens, last.num_generated_tokens),
            (self.spec_decode_num_drafts, stats.num_spec_drafts, last.num_spec_drafts),
            (self.spec_decode_num_draft_tokens, stats.num_draft_tokens, last.num_draft_tokens),
            (
                self.spec_decode_num_accepted_tokens,
                stats.num_accepted_tokens,
                last.num_accepted_tokens,
            ),
        ):
            if now > before:
                counter.inc(now - before)
        before_pos = last.num_accepted_per_pos
        for pos, now in enumerate(stats.num_accepted_per_pos):
            before = before_pos[pos] if pos < len(before_pos) else 0
            if now > before:
                self.spec_decode_num_accepted_tokens_per_pos.labels(self.model_name, str(pos)).inc(
                    now - before
                )
        self._last = stats

    @property
    def exports_lora_info(self) -> bool:
        return self._lora_info is not None

    def record_sleep_level(self, level: int) -> None:
        """The engine sleeps at ``level`` (0: awake, also once woken whole)."""
        for i, state in enumerate(SLEEP_STATES):
            self._sleep_state.labels(self.model_name, state).set(float(i == level))

    def record_lora_adapters(self, running: list[str], waiting: list[str]) -> None:
        """The adapters the running and the waiting requests use now (names comma-separated,
        as vLLM's labels; the one labelled sample replaces the previous)."""
        gauge = self._lora_info
        if gauge is None:
            return
        labels = (",".join(running), ",".join(waiting), self._max_loras)
        if labels != self._lora_labels:
            gauge.clear()
            self._lora_labels = labels
        gauge.labels(*labels).set(time.time())

    def record_step(self, num_tokens: int, num_passes: int = 1) -> None:
        """An engine step computed ``num_tokens`` in each of ``num_passes`` forward passes."""
        for _ in range(num_passes):
            self.iteration_tokens.observe(num_tokens)

    def record_request_times(
        self,
        arrival: float,
        scheduled: float,
        first_token: float,
        last_token: float,
        num_generated: int,
    ) -> None:
        """A finished request's phases, from its times (one monotonic clock)."""
        decode = last_token - first_token
        self.request_queue_time.observe(scheduled - arrival)
        self.request_prefill_time.observe(first_token - scheduled)
        self.request_decode_time.observe(decode)
        self.request_inference_time.observe(last_token - scheduled)
        if num_generated > 1:
            self.request_time_per_output_token.observe(decode / (num_generated - 1))

    def record_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)
        if self._old_itl is not None:
            self._old_itl.observe(seconds)

    def record_finished(
        self,
        finish_reason: str,
        num_prompt_tokens: int = 0,
        num_generated: int = 0,
        max_tokens: int | None = None,
    ) -> None:
        """A request ended: by ``finish_reason``; finished ones (not aborted or failed) count
        their prompt and generated tokens too, and their ``max_tokens`` (None: an embedding)."""
        self.request_success.labels(self.model_name, finish_reason).inc()
        if finish_reason not in ("abort", "error"):
            self.request_prompt_tokens.observe(num_prompt_tokens)
            self.request_generation_tokens.observe(num_generated)
            if max_tokens is not None:
                self.request_params_max_tokens.observe(max_tokens)


class StatsLogger:
    """Logs one vLLM-style line every ``interval_s`` while the engine has work.

    Throughputs are averages over the window since the previous line; the prefix-cache hit rate
    is cumulative since start. The engine thread calls ``maybe_log`` after each iteration and,
    while idle, sleeps at most ``next_due()`` seconds so that the window in which the engine went
    idle still gets its line. After an idle line the window restarts at the next call, so a quiet
    hour does not dilute the next line's throughput. ``interval_s`` inf turns logging off.
    """

    def __init__(self, initial: EngineStats, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last = initial  # counters at the start of the window
        self._start = 0.0  # when the window started (monotonic seconds)
        self._idle = True  # no window open: the next call starts one

    def next_due(self, now: float) -> float | None:
        """Seconds until the open window's line is due; None when no window is open."""
        if self._idle or math.isinf(self.interval_s):
            return None
        return max(0.0, self._start + self.interval_s - now)

    def maybe_log(self, stats: EngineStats, now: float) -> None:
        last = self._last
        if self._idle:
            # Counters do not move while idle, so the old snapshot still starts the new window
            # (and the tokens of the request that ended the idle period count in it).
            self._start, self._idle = now, False
            return
        elapsed = now - self._start
        if elapsed < self.interval_s:
            return
        busy = stats.num_running > 0 or stats.num_waiting > 0
        moved = (
            stats.num_prompt_tokens != last.num_prompt_tokens
            or stats.num_generated_tokens != last.num_generated_tokens
        )
        if busy or moved:
            queries = stats.num_prefix_queries
            hit_rate = stats.num_prefix_hits / queries if queries else 0.0
            line = (
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%"
            )
            args = [
                (stats.num_prompt_tokens - last.num_prompt_tokens) / elapsed,
                (stats.num_generated_tokens - last.num_generated_tokens) / elapsed,
                stats.num_running,
                stats.num_waiting,
                100 * stats.kv_cache_usage,
                100 * hit_rate,
            ]
            if stats.num_host_queries:  # a host KV tier (vLLM's line with a KV connector)
                line += ", External prefix cache hit rate: %.1f%%"
                args.append(100 * stats.num_host_hits / stats.num_host_queries)
            logger.info(line, *args)
        num_drafts = stats.num_spec_drafts - last.num_spec_drafts
        if num_drafts:
            _log_drafts(stats, last, num_drafts)
        self._last, self._start, self._idle = stats, now, not busy


def _log_drafts(stats: EngineStats, last: EngineStats, num_drafts: int) -> None:
    """vLLM's speculative-decoding line for a window: the tokens a step of a request with
    drafts gave on average (its kept drafts and one), and the drafts kept, overall and at each
    position among a step's drafts."""
    drafted = stats.num_draft_tokens - last.num_draft_tokens
    accepted = stats.num_accepted_tokens - last.num_accepted_tokens
    before = last.num_accepted_per_pos
    per_pos = [
        (now - (before[i] if i < len(before) else 0)) / num_drafts
        for i, now in enumerate(stats.num_accepted_per_pos)
    ]
    logger.info(
        "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d "
        "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
        1 + accepted / num_drafts,
        accepted,
        drafted,
        ", ".join(f"{rate:.3f}" for rate in per_pos),
        100 * accepted / drafted if drafted else 0.0,
    )
