"""The hand-written wire encoding of streamed bodies equals protobuf's own."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from narwhal.core.errors import backend_unavailable
from narwhal.core.exchange import Body, Headers, Immediate, Trailers
from narwhal.server.extproc import encode, to_proto


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 15990, 15996, 16000, 16383, 16384, 70000,
                                  2_100_000])
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


def test_header_reply_naming_an_engine_clears_the_route_cache():
    action = Headers(False, set=[("x-gateway-destination-endpoint", "10.0.0.1:8000")],
                     destination="10.0.0.1:8000")
    fast = encode(action)
    assert fast == to_proto(action).SerializeToString()
    assert pb.ProcessingResponse.FromString(fast).request_headers.response.clear_route_cache
    plain = pb.ProcessingResponse.FromString(encode(Headers(True, set=[("a", "b")])))
    assert not plain.response_headers.response.clear_route_cache


@pytest.mark.parametrize("value,expected", [
    (["10.0.0.1:8000", "10.0.0.2:8000"], ["10.0.0.1:8000", "10.0.0.2:8000"]),
    ("10.0.0.1:8000, 10.0.0.2:8000", ["10.0.0.1:8000", "10.0.0.2:8000"]),
    ([], []), ("", []), (5, []),
])
def test_subset_hint_from_request_metadata(value, expected):
    from google.protobuf import struct_pb2

    from narwhal.server.extproc import SUBSET_KEY, SUBSET_NAMESPACE, _subset_hint

    msg = pb.ProcessingRequest()
    assert _subset_hint(msg) is None
    ns = struct_pb2.Struct()
    ns.update({SUBSET_KEY: value})
    msg.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(ns)
    assert _subset_hint(msg) == expected


def test_access_log_verdicts():
    from envoy.data.accesslog.v3 import accesslog_pb2

    from narwhal.server.access_log import verdict

    assert verdict(accesslog_pb2.ResponseFlags(upstream_remote_reset=True)) == "failed"
    assert verdict(accesslog_pb2.ResponseFlags(upstream_protocol_error=True)) == "failed"
    assert verdict(accesslog_pb2.ResponseFlags(downstream_connection_termination=True)) == \
        "cancelled"
    assert verdict(accesslog_pb2.ResponseFlags()) == "cancelled"
