"""The hand-written wire encoding of streamed bodies equals protobuf's own."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from narwhal.core.errors import backend_unavailable
from narwhal.core.exchange import Body, Headers, Immediate, Trailers
from narwhal.server.extproc import encode, to_proto


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, 70000, 2_100_000])
@pytest.mark.parametrize("response", [True, False])
@pytest.mark.parametrize("eos", [True, False])
def test_body_encoding_matches_protobuf(size, response, eos):
    action = Body(response, bytes(range(256)) * (size // 256) + b"x" * (size % 256), eos)
    fast = encode(action)
    assert fast == to_proto(action).SerializeToString()
    parsed = pb.ProcessingResponse.FromString(fast)
    which = parsed.response_body if response else parsed.request_body
    sent = which.response.body_mutation.streamed_response
    assert sent.body == action.data and sent.end_of_stream is eos


@pytest.mark.parametrize("action", [
    Headers(False, set=[("a", "b")], remove=["c"], destination="127.0.0.1:1"),
    Headers(False, set=[("x-gateway-destination-endpoint", "[::1]:8000"),
                        ("content-length", "123")], remove=["accept-encoding",
                                                            "transfer-encoding"],
            destination="[::1]:8000"),
    Headers(False, destination="10.0.0.1:80", set=[("k", "v" * 300)]),
    Headers(True), Headers(True, remove=["content-length"]),
    Headers(True, set=[("content-type", "application/json"), ("x-narwhal-predicted-ttft-ms",
                                                                "12")]),
    Trailers(True), Trailers(False), Immediate(backend_unavailable())])
def test_other_actions_encode_as_protobuf_does(action):
    assert encode(action) == to_proto(action).SerializeToString()
