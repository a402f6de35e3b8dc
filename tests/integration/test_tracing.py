"""One trace per request across the services: the test process runs an OTLP/gRPC receiver that
keeps every span in memory; a disaggregated stack exports to it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from ports import free_port
from procs import Service, launch_disaggregated, stop

pytestmark = pytest.mark.integration


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver holding (service, span name, trace id, span id, parent id)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, bytes, bytes, bytes]] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for rs in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in rs.resource.attributes
                        if a.key == "service.name"
                    ),
                    "?",
                )
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            (service, s.name, s.trace_id, s.span_id, s.parent_span_id)
                        )
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    collector = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    try:
        yield collector, f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)


def _tree_closed(spans: list[tuple[str, str, bytes, bytes, bytes]]) -> bool:
    """Whether the trace of the gateway's completion span has a root and every parent of its
    spans has arrived."""
    completion = ("baton-gateway", "gateway completion")
    tids = [tid for svc, name, tid, _, _ in spans if (svc, name) == completion]
    if not tids:
        return False
    in_trace = [(sid, parent) for _, _, tid, sid, parent in spans if tid == tids[0]]
    ids = {sid for sid, _ in in_trace}
    return any(not parent for _, parent in in_trace) and all(
        not parent or parent in ids for _, parent in in_trace
    )


def test_spans_of_one_request_share_one_trace(receiver: tuple[Receiver, str]) -> None:
    collector, endpoint = receiver
    otlp = ["--otlp-endpoint", endpoint]
    services: list[Service] = []
    try:
        gateway = launch_disaggregated(services, worker_args=otlp, gateway_args=otlp)
        r = httpx.post(
            f"{gateway.address}/v1/completions",
            json={"prompt": "Tracing a request through Baton", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text

        want = {
            ("baton-gateway", "gateway completion"),
            ("baton-gateway", "route"),
            ("baton-gateway", "prefill"),
            ("baton-prefill", "prefill worker"),
            ("baton-gateway", "decode"),
            ("baton-decode", "decode worker"),
            ("baton-decode", "kv_transfer"),
        }
        # Wait for every span of the tree: the root ends last (after the response body), so
        # the gateway may export it in a later batch than its children.
        deadline = time.monotonic() + 20
        while True:
            with collector.lock:
                spans = list(collector.spans)
            if want <= {(svc, name) for svc, name, *_ in spans} and _tree_closed(spans):
                break
            assert time.monotonic() < deadline, sorted({(s, n) for s, n, *_ in spans})
            time.sleep(0.2)
    finally:
        stop(reversed(services))

    by_name = {(svc, name): (tid, sid, parent) for svc, name, tid, sid, parent in spans}
    trace_ids = {by_name[key][0] for key in want}
    assert len(trace_ids) == 1, "the request's spans are spread over several traces"
    (trace_id,) = trace_ids
    in_trace = [(svc, sid, parent) for svc, _, tid, sid, parent in spans if tid == trace_id]
    ids = {sid for _, sid, _ in in_trace}
    roots = [svc for svc, _, parent in in_trace if not parent]
    assert roots == ["baton-gateway"], roots  # one tree, rooted at the gateway (FastAPI's span
    assert all(not parent or parent in ids for _, _, parent in in_trace)  # or ours), connected
    # The worker spans are children of the gateway's client spans (context crossed gRPC).
    assert (
        by_name[("baton-prefill", "prefill worker")][2] == by_name[("baton-gateway", "prefill")][1]
    )
    assert by_name[("baton-decode", "decode worker")][2] == by_name[("baton-gateway", "decode")][1]
    assert (
        by_name[("baton-decode", "kv_transfer")][2] == by_name[("baton-decode", "decode worker")][1]
    )
    root_sid = by_name[("baton-gateway", "gateway completion")][1]
    assert by_name[("baton-gateway", "route")][2] == root_sid
