"""Narwhal's ext_proc port, spoken to by the official grpcio client (no Envoy in between)."""

from __future__ import annotations

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICES = ["", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]


@pytest.fixture
def channel(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.extproc_port}") as ch:
        yield ch


@pytest.mark.parametrize("service", SERVICES)
def test_health_check_serving(channel, service):
    resp = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_health_check_unknown_service(channel):
    with pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_watch_streams_current_status(channel):
    stream = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
    assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
    stream.cancel()


def test_unknown_method_is_unimplemented(channel):
    call = channel.unary_unary("/no.Such/Method")
    with pytest.raises(grpc.RpcError) as info:
        call(b"", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED



def test_ext_proc_immediate_response_over_grpcio(channel, stack):
    stub = pb_grpc.ExternalProcessorStub(channel)
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key="content-length", raw_value=b"99999999")])))
    (resp,) = list(stub.Process(iter([req]), timeout=5))
    assert resp.immediate_response.status.code == 413
    assert b"request_too_large" in resp.immediate_response.body


def test_ext_proc_full_exchange_over_grpcio(channel):
    body = (b'{"model": "narwhal-sim", "max_tokens": 2, '
            b'"messages": [{"role": "user", "content": "x"}]}')
    msgs = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST")]))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]
    replies = list(pb_grpc.ExternalProcessorStub(channel).Process(iter(msgs), timeout=5))
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["request_headers", "request_body"]
    lb = replies[0].dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value.startswith("127.0.0.1:")
    sent = replies[1].request_body.response.body_mutation.streamed_response
    assert sent.end_of_stream and b'"stream":true' in sent.body
