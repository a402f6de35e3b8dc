"""The gateway's ``/metrics``: its own metrics plus every worker's, labelled by worker.

The gateway's own metrics are what a client sees (arrival at the gateway to first SSE token, to
the last); they are named ``baton:gateway_*`` because the workers already export
``baton:time_to_first_token_seconds`` and friends (as measured by the engine), and one exposition
cannot hold two families with the same name. The workers' metrics are fetched from each worker's
``metrics_url`` at scrape time and re-emitted with a ``worker="<address>"`` label on every sample,
so ``curl gateway/metrics | grep num_requests`` shows running and waiting requests per worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from baton import tracing

# vLLM's buckets, so dashboards built for vLLM read these unchanged.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_SCRAPE_TIMEOUT_S = 2.0


def relabel(
    families_by_worker: Mapping[str, Iterable[Metric]], roles: Mapping[str, str] | None = None
) -> list[Metric]:
    """Merge the workers' metric families into one family per name, each sample labelled with
    ``worker=<address>`` (replacing a ``worker`` label the worker may already have set) and, when
    ``roles`` names it, ``role=<prefill|decode>``."""
    merged: dict[str, Metric] = {}
    for addr, families in families_by_worker.items():
        for family in families:
            out = merged.get(family.name)
            if out is None:
                out = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = out
            for s in family.samples:
                labels = {**s.labels, "worker": addr}
                if roles is not None and addr in roles:
                    labels["role"] = roles[addr]
                out.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
    return list(merged.values())


def parse_metrics(text: str) -> list[Metric]:
    """Prometheus text format -> metric families. Raises ValueError on malformed text."""
    return list(text_string_to_metric_families(text))


class _StaticCollector:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render(families: list[Metric]) -> bytes:
    """Metric families -> Prometheus text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StaticCollector(families))
    return generate_latest(registry)


@dataclass(slots=True)
class RequestRecord:
    """One HTTP request in flight; :meth:`GatewayMetrics.finish` records it once."""

    endpoint: str
    arrival: float  # time.monotonic()
    done: bool = False
    span: tracing.Span | None = None  # the request's root span (a no-op one when tracing is off)


class GatewayMetrics:
    """The gateway's own metrics, in their own registry (tests may run several gateways)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.num_running = 0  # requests in flight (vLLM's /load "server_load")
        self._requests = Counter(
            "baton:gateway_requests",
            "Requests answered, by endpoint and outcome (ok, error, cancelled, or HTTP status)",
            ["model_name", "endpoint", "status"],
            registry=r,
        )
        self._running = Gauge(
            "baton:gateway_num_requests_running", "Requests the gateway is serving", m, registry=r
        ).labels(model_name)
        self._ttft = Histogram(
            "baton:gateway_time_to_first_token_seconds",
            "Arrival at the gateway to the first generated token",
            m,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._e2e = Histogram(
            "baton:gateway_e2e_request_latency_seconds",
            "Arrival at the gateway to the end of the response",
            m,
            buckets=_E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._prompt_tokens = Counter(
            "baton:gateway_prompt_tokens", "Prompt tokens sent to workers", m, registry=r
        ).labels(model_name)
        self._generation_tokens = Counter(
            "baton:gateway_generation_tokens", "Tokens received from workers", m, registry=r
        ).labels(model_name)
        self._worker_up = Gauge(
            "baton:gateway_worker_metrics_up",
            "1 if the worker's metrics could be fetched at the last scrape",
            ["worker"],
            registry=r,
        )
        self._decisions = Counter(
            "baton:disagg_decisions",
            "Routing decisions: remote prefill, or local prefill and why",
            ["model_name", "decision"],
            registry=r,
        )

    def record_decision(self, decision: str) -> None:
        self._decisions.labels(self.model_name, decision).inc()

    def start(self, endpoint: str) -> RequestRecord:
        self._running.inc()
        self.num_running += 1
        span = tracing.start_span(f"gateway {endpoint}", kind=tracing.SpanKind.SERVER)
        return RequestRecord(endpoint, time.monotonic(), span=span)

    def finish(
        self,
        record: RequestRecord,
        status: str,
        *,
        first_token_time: float | None = None,
        num_prompt_tokens: int = 0,
        num_generation_tokens: int = 0,
    ) -> None:
        """Record how ``record`` ended; later calls for the same record are ignored."""
        if record.done:
            return
        record.done = True
        if record.span is not None:
            record.span.set_attribute("baton.status", status)
            record.span.set_attribute("baton.prompt_tokens", num_prompt_tokens)
            record.span.set_attribute("baton.generation_tokens", num_generation_tokens)
            tracing.end_span(record.span, None if status == "ok" else status)
        self._running.dec()
        self.num_running -= 1
        self._requests.labels(self.model_name, record.endpoint, status).inc()
        if first_token_time is not None:
            self._ttft.observe(first_token_time - record.arrival)
        if status == "ok":
            self._e2e.observe(time.monotonic() - record.arrival)
        self._prompt_tokens.inc(num_prompt_tokens)
        self._generation_tokens.inc(num_generation_tokens)

    async def scrape(
        self,
        client: httpx.AsyncClient,
        metrics_urls: Mapping[str, str],
        roles: Mapping[str, str] | None = None,
    ) -> bytes:
        """The whole ``/metrics`` body: the gateway's metrics, then the workers' (fetched now,
        concurrently; a worker that cannot be read is left out and marked down)."""

        async def fetch(url: str) -> list[Metric] | None:
            try:
                resp = await client.get(url, timeout=_SCRAPE_TIMEOUT_S)
                resp.raise_for_status()
                return parse_metrics(resp.text)
            except (httpx.HTTPError, ValueError):
                return None

        addrs = [a for a, url in metrics_urls.items() if url]
        results = await asyncio.gather(*(fetch(metrics_urls[a]) for a in addrs))
        by_worker: dict[str, list[Metric]] = {}
        for addr, families in zip(addrs, results, strict=True):
            self._worker_up.labels(addr).set(0 if families is None else 1)
            if families is not None:
                by_worker[addr] = families
        return generate_latest(self.registry) + render(relabel(by_worker, roles))
