"""Tracing end to end: requests through Envoy and Narwhal, spans exported over OTLP/gRPC to
a real OTLP trace receiver (the collector protocol's gRPC service, run in this process),
continuing the client's W3C trace context."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from narwhal.launch import SimSpec, Stack, free_port

from .conftest import MODEL

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the protocol's name)
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, want: int, timeout: float = 20.0) -> list:
        """The spans of one trace, once ``want`` of them arrived (polled)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                got = [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]
            if len(got) >= want:
                return got
            time.sleep(0.05)
        raise AssertionError(f"only {len(got)} of {want} spans of {trace_id} arrived")


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[Stack, Receiver]]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    stack = Stack(sims=[SimSpec("sim-t")], model=MODEL, config={"telemetry": {"tracing": {
        "enabled": True, "endpoint": f"http://127.0.0.1:{port}", "service_name": "narwhal-t"}}})
    stack.start()
    try:
        yield stack, receiver
    finally:
        stack.stop()
        server.stop(0)


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_request_spans_continue_the_callers_trace(traced, stream):
    stack, receiver = traced
    trace_id = TRACE_ID[:-1] + ("1" if stream else "2")
    resp = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30,
                      headers={"traceparent": f"00-{trace_id}-{PARENT_ID}-01"},
                      json={"model": MODEL, "max_tokens": 5, "stream": stream,
                            "messages": [{"role": "user", "content": "trace me"}]})
    assert resp.status_code == 200
    spans = receiver.trace(trace_id, 4)
    assert {svc for svc, _ in spans} == {"narwhal-t"}
    by_name = {s.name: s for _, s in spans}
    assert set(by_name) == {"narwhal.request", "narwhal.admission", "narwhal.placement",
                            f"chat {MODEL}"}  # not queued: no queue span
    root = by_name["narwhal.request"]
    assert root.parent_span_id.hex() == PARENT_ID  # the caller's span is the parent
    assert attrs(root)["narwhal.outcome"] == "completed"
    for name in ("narwhal.admission", "narwhal.placement", f"chat {MODEL}"):
        assert by_name[name].parent_span_id == root.span_id
    up = by_name[f"chat {MODEL}"]
    a = attrs(up)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    assert a["server.port"] == stack.sims[0].port
    assert 0 < a["gen_ai.server.time_to_first_token"] <= a["narwhal.ttft_s"]
    assert root.start_time_unix_nano <= up.start_time_unix_nano <= up.end_time_unix_nano \
        <= root.end_time_unix_nano
    assert attrs(by_name["narwhal.placement"])["narwhal.engine"] == "sim-t"


def test_a_refused_request_is_traced_with_its_reason(traced):
    stack, receiver = traced
    trace_id = TRACE_ID[:-1] + "3"
    resp = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30,
                      headers={"traceparent": f"00-{trace_id}-{PARENT_ID}-01"},
                      json={"model": "no-such-model", "messages": [{"role": "user",
                                                                    "content": "x"}]})
    assert resp.status_code == 404
    spans = receiver.trace(trace_id, 2)
    by_name = {s.name: s for _, s in spans}
    assert set(by_name) == {"narwhal.request", "narwhal.admission"}
    root = by_name["narwhal.request"]
    assert root.status.code == 2  # STATUS_CODE_ERROR
    assert attrs(root)["http.response.status_code"] == 404
    assert attrs(by_name["narwhal.admission"])["narwhal.refusal"] == "model_not_found"
