"""OpenTelemetry tracing shared by every service: one trace per request across gateway, route,
prefill, KV transfer and decode, with W3C trace context carried in gRPC metadata.

Off unless an OTLP endpoint is given (``--otlp-endpoint`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``): then spans are batched to it over OTLP/gRPC. Spans are
never made "current" across ``await`` points (async generators resume in other contexts);
parents are passed explicitly instead.
Torch-free, so the gateway can use it.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable, Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

logger = logging.getLogger(__name__)

_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
_tracer: trace.Tracer = trace.NoOpTracer()

__all__ = [
    "Context",
    "Span",
    "SpanKind",
    "add_otlp_argument",
    "context_with",
    "end_span",
    "extract",
    "inject",
    "setup",
    "start_span",
]


def add_otlp_argument(parser: argparse.ArgumentParser) -> None:
    """``--otlp-endpoint``, the same on every service's command line."""
    parser.add_argument(
        "--otlp-endpoint",
        "--otlp-traces-endpoint",  # (vLLM's name)
        dest="otlp_endpoint",
        default=None,
        help="send OpenTelemetry spans there over OTLP/gRPC "
        f"(default: ${_ENDPOINT_ENV}; unset: no tracing)",
    )


def setup(service_name: str, otlp_endpoint: str | None = None) -> bool:
    """Export this process's spans to ``otlp_endpoint`` (or the standard env var) under
    ``service_name``; returns whether tracing is on. Call once, at startup."""
    global _tracer
    endpoint = otlp_endpoint or os.environ.get(_ENDPOINT_ENV)
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    insecure = not endpoint.startswith("https://")
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("baton")
    logger.info("tracing: spans of %s go to %s", service_name, endpoint)
    return True


def shutdown() -> None:
    """Flush pending spans (at exit)."""
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "shutdown", None)
    if flush is not None:
        flush()


def start_span(
    name: str,
    parent: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, str | int | float | bool] | None = None,
) -> Span:
    """A span under ``parent`` (a context from ``extract`` or ``context_with``); end it with
    ``end_span``."""
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes)


def end_span(span: Span, error: BaseException | str | None = None) -> None:
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


def context_with(span: Span) -> Context:
    """The context whose current span is ``span`` (the parent for its children)."""
    return trace.set_span_in_context(span)


def inject(parent: Context | None) -> list[tuple[str, str]]:
    """W3C trace-context headers for a gRPC call made under ``parent``."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=parent)
    return list(carrier.items())


def extract(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from a call's invocation metadata."""
    carrier = {k: v if isinstance(v, str) else v.decode() for k, v in metadata or ()}
    return propagate.extract(carrier)
