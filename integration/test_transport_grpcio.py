"""`serving.transport: grpcio` (the benchmark's comparison transport) serves the same path."""

from __future__ import annotations

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from narwhal.launch import SimSpec

from .conftest import MODEL, _stack, client_for, unix_socket

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def grpcio_stack():
    yield from _stack([SimSpec("sim-g")], {"serving": {"transport": "grpcio",
                                                       "extproc_socket": unix_socket()}})


def test_round_trips(grpcio_stack):
    client = client_for(grpcio_stack)
    resp = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, seed=1)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5,
                                                 seed=1, stream=True))
    assert resp.choices[0].message.content == "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MSGS)


def test_health(grpcio_stack):
    with grpc.insecure_channel(f"127.0.0.1:{grpcio_stack.extproc_port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
