"""Property-based tests (hypothesis): every parser Narwhal runs on peer bytes fails only in
its own declared way, whatever it is fed, and the exchange keeps its accounting invariant
under any sequence of ext_proc messages. Example counts are fixed, so the run is bounded
in time (this is the fuzz run CI does)."""

from __future__ import annotations

import json
import os

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal.config import parse
from narwhal.core.assembly import Assembler
from narwhal.core.errors import HttpError
from narwhal.core.exchange import Exchange
from narwhal.core.meter import EngineOutputError, Meter
from narwhal.core.request import parse_request, upstream_body
from narwhal.core.router import Router
from narwhal.core.sse import SSEError, SSEParser
from narwhal.core.tokens import TokenIdError
from narwhal.server import http2
from narwhal.server.grpc_server import GrpcConnection

# NARWHAL_FUZZ_EXAMPLES raises the count for a longer hunt than CI's.
SETTINGS = settings(max_examples=int(os.environ.get("NARWHAL_FUZZ_EXAMPLES", "150")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["content", "role", "tool_calls", "index", "id",
                                       "function", "name", "arguments", "text", "delta",
                                       "logprobs", "finish_reason", "token_ids", "x"]),
                      children, max_size=5),
    max_leaves=25)


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in points:
        out.append(data[prev:p])
        prev = p
    out.append(data[prev:])
    return out


# -- SSE --------------------------------------------------------------------------------
@SETTINGS
@given(st.lists(st.binary(min_size=0, max_size=40).filter(lambda b: b"\n" not in b
                                                           and b"\r" not in b), max_size=8),
       st.lists(st.integers(0, 10_000), max_size=12))
def test_sse_events_do_not_depend_on_chunking(payloads, cuts):
    stream = b"".join(b"data: " + p + b"\n\n" for p in payloads)
    whole = SSEParser().feed(stream)
    parser = SSEParser()
    split = [e for part in chunks(stream, cuts) for e in parser.feed(part)] + parser.close()
    assert split == whole == list(payloads)


@SETTINGS
@given(st.lists(st.sampled_from([b"data: {\"a\": 1}", b"data: [DONE]", b"data:x", b"data: ",
                                 b"data: a\r", b": keep-alive", b"event: e", b"id: 1", b"",
                                 b"data: data: ", b"dat", b"\r"]), max_size=12),
       st.integers(8, 40))
def test_sse_whole_chunk_parses_as_byte_by_byte(lines, limit):
    """The parser's shortcuts for a chunk of whole events find what its line loop finds
    one byte at a time: the same payloads, or the same refusal of an oversized event."""
    stream = b"\n".join(lines) + b"\n\n"

    def parse(parts: list[bytes]) -> list[bytes] | str:
        parser = SSEParser(max_event_bytes=limit)
        try:
            return [e for part in parts for e in parser.feed(part)] + parser.close()
        except SSEError:
            return "refused"

    assert parse([stream]) == parse([stream[i:i + 1] for i in range(len(stream))])


@SETTINGS
@given(st.binary(max_size=400), st.lists(st.integers(0, 500), max_size=6))
def test_sse_parser_only_raises_its_own_error(data, cuts):
    parser = SSEParser(max_event_bytes=64)
    try:
        for part in chunks(data, cuts):
            parser.feed(part)
        parser.close()
    except SSEError:
        pass


# -- request validation -----------------------------------------------------------------
@SETTINGS
@given(st.dictionaries(st.sampled_from(["model", "messages", "prompt", "stream", "n",
                                        "stream_options", "max_tokens", "tools",
                                        "tool_choice", "echo", "include_reasoning",
                                        "return_token_ids", "audio", "modalities"]),
                       json_values, max_size=8),
       st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_request_validation_answers_or_refuses(body, path):
    try:
        req = parse_request(path, orjson.dumps(body), "m")
    except HttpError as exc:
        assert exc.status in (400, 404)
    else:
        assert req.chat == (path == "/v1/chat/completions")


@SETTINGS
@given(st.dictionaries(st.sampled_from(["seed", "top_k", "x_custom", "logit_bias"]),
                       st.integers() | st.lists(st.integers(), max_size=3), max_size=4),
       st.sampled_from([", ", ","]))
def test_every_integer_reaches_the_engine_as_sent(fields, separator):
    """Whatever their size: fields Narwhal does not interpret are forwarded exactly."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields
    raw = json.dumps(body, separators=(separator, ":")).encode()
    up = json.loads(upstream_body(parse_request("/v1/chat/completions", raw, "m"), False))
    assert {k: up[k] for k in fields} == fields


@SETTINGS
@given(st.binary(max_size=200))
def test_request_validation_on_arbitrary_bytes(raw):
    try:
        parse_request("/v1/chat/completions", raw, "m")
    except HttpError as exc:
        assert exc.status in (400, 404)


# -- engine output: metering and assembly --------------------------------------------------
@SETTINGS
@given(st.lists(json_values, max_size=6), st.booleans(), st.booleans())
def test_metering_and_assembly_fail_only_as_bad_engine_output(events, chat, ids):
    meter = Meter(chat, ids)
    assembler = Assembler(chat, ids)
    try:
        for event in events:
            wrapped = event if isinstance(event, dict) and "choices" in event else {
                "choices": [event] if isinstance(event, dict) else event}
            meter.observe(wrapped)
            assembler.feed(wrapped)
        assembler.body({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    except (EngineOutputError, TokenIdError):
        pass


# -- HTTP/2 and gRPC framing ---------------------------------------------------------------
frames = st.builds(
    lambda kind, flags, sid, payload: (len(payload).to_bytes(3, "big") + bytes((kind, flags))
                                       + sid.to_bytes(4, "big") + payload),
    st.integers(0, 11), st.integers(0, 255), st.sampled_from([0, 1, 2, 3, 5, 2**31 - 1]),
    st.binary(max_size=40))


@SETTINGS
@given(st.lists(frames, max_size=12), st.lists(st.integers(0, 1000), max_size=6))
def test_http2_connection_never_raises(frame_list, cuts):
    conn = http2.ServerConnection()
    conn.initiate()
    data = http2.PREFACE + b"".join(frame_list)
    for part in chunks(data, cuts):
        for ev in conn.receive(part):
            assert isinstance(ev, http2.RequestReceived | http2.DataReceived | http2.StreamReset
                              | http2.WindowUpdated | http2.ConnectionTerminated)
            if isinstance(ev, http2.WindowUpdated) and ev.stream_id:
                assert conn.send_window(ev.stream_id) > 0 or conn.conn_send_window <= 0
        if conn.closed:
            assert conn.receive(b"\x00" * 9) == []
        while (sid := conn.woken()) is not None:
            assert sid in conn.send_credit
        for sid in list(conn.send_credit):  # every stream has more to send than windows allow
            conn.send_data(sid, b"x" * 70_000)
        waiting = set(conn.wanting_connection) | set(conn.wanting_own)
        assert waiting <= set(conn.send_credit)
        assert not set(conn.wanting_connection) & set(conn.wanting_own)
    assert len(conn.send_credit) <= conn.max_streams
    assert conn.conn_recv_window <= conn.window


class Transport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Recorder:
    def __init__(self, stream) -> None:
        self.messages: list[bytes] = []
        self.half_closed = False

    def on_message(self, data: bytes) -> None:
        self.messages.append(data)

    def on_half_close(self) -> None:
        self.half_closed = True

    def on_cancel(self) -> None:
        pass


@SETTINGS
@given(st.lists(st.binary(max_size=3000), min_size=1, max_size=5),
       st.lists(st.integers(0, 20_000), max_size=10))
def test_grpc_messages_survive_any_chunking(messages, cuts):
    import h2.config
    import h2.connection

    calls: list[Recorder] = []

    def factory(stream):
        calls.append(Recorder(stream))
        return calls[-1]

    conn = GrpcConnection({b"/svc/M": factory})
    conn.transport = Transport()
    conn.http2.initiate()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                            (":path", "/svc/M"), ("content-type", "application/grpc")])
    body = b"".join(b"\x00" + len(m).to_bytes(4, "big") + m for m in messages)
    for i in range(0, len(body), 16384):
        client.send_data(1, body[i:i + 16384], end_stream=i + 16384 >= len(body))
    for part in chunks(client.data_to_send(), cuts):
        conn.data_received(part)
    (call,) = calls
    assert call.messages == messages and call.half_closed


# -- the exchange under arbitrary ext_proc message sequences --------------------------------
HEADERS = st.fixed_dictionaries(
    {":path": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/x"]),
     ":method": st.sampled_from(["POST", "GET"])},
    optional={"content-length": st.text("0123456789²", max_size=6),
              "x-slo-ttft-ms": st.text("0123456789-.", max_size=6),
              "x-request-timeout-ms": st.text("0123456789", max_size=14),
              "x-gateway-inference-objective": st.sampled_from(["urgent", "batch", "other"])})
BODIES = st.sampled_from([
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}',
    b'{"model": "m", "prompt": "x", "echo": true}', b"{", b"", b"[]"])
RESPONSES = st.sampled_from([
    b'data: {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [1]}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n',
    b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\n',
    b'data: {"error": {"message": "no", "code": 400}}\n\n', b"data: [DONE]\n\n", b"data: {",
    b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n', b"garbage"])
STEPS = st.lists(st.one_of(
    st.tuples(st.just("request_headers"), HEADERS, st.booleans()),
    st.tuples(st.just("request_body"), BODIES, st.booleans()),
    st.tuples(st.just("request_trailers")),
    st.tuples(st.just("response_headers"),
              st.fixed_dictionaries({":status": st.sampled_from(["200", "400", "5x0", "²"]),
                                     "content-type": st.sampled_from(
                                         ["text/event-stream", "application/json"])}),
              st.booleans()),
    st.tuples(st.just("response_body"), RESPONSES, st.booleans()),
    st.tuples(st.just("response_trailers")),
    st.tuples(st.just("expire"))), max_size=12)


@SETTINGS
@given(st.lists(STEPS, min_size=1, max_size=3))
def test_exchange_keeps_its_invariants(sequences):
    router = Router(parse({"serving": {"model": "m"},
                           "telemetry": {"close_verdict_ms": 0},
                           # one request at a time: the others queue, by priority
                           "scheduler": {"max_prefill_per_engine": 1},
                           "admission": {"objectives": {"urgent": 5, "batch": -1}},
                           "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]}))
    for e in router.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = router.clock()
    router.started = True
    exchanges = []
    for steps in sequences:
        ex = Exchange(router)
        exchanges.append(ex)
        for step in steps:
            getattr(ex, step[0])(*step[1:])
            acct = router.accounting
            assert acct.balanced() and acct.in_flight >= 0 and router.held >= 0
            assert router.held_bytes == sum(x.held_bytes for x in exchanges) >= 0
            assert all(e.prefill >= 0 and e.decode >= 0 for e in router.engines)
            queue = router.scheduler.queue
            assert router.scheduler.prioritized == sum(1 for t in queue if t.priority)
            assert router.scheduler.queued_tokens == sum(t.tokens for t in queue)
            assert all(t.priority >= 0 for t in queue)  # the sheddable never wait
    for ex in exchanges:
        ex.close()
    acct = router.accounting
    assert acct.in_flight == 0 and router.held == 0 and acct.balanced()
    assert router.held_bytes == 0
    assert all(e.in_flight == 0 for e in router.engines) and not router.scheduler.queue
    assert router.scheduler.prioritized == 0


def test_many_small_messages_in_one_buffer_are_linear():
    """300k empty messages arriving in one piece: delivered by walking the buffer once,
    not by re-slicing what is left after each message."""
    import time

    calls: list[Recorder] = []
    conn = GrpcConnection({b"/svc/M": lambda stream: calls.append(Recorder(stream))
                           or calls[-1]})
    conn.transport = Transport()
    conn.http2.initiate()
    conn._request(http2.RequestReceived(1, [(b":path", b"/svc/M")], False))
    data = b"\x00\x00\x00\x00\x00" * 300_000
    start = time.process_time()
    conn._data(http2.DataReceived(1, data, True))
    assert time.process_time() - start < 3.0
    (call,) = calls
    assert len(call.messages) == 300_000 and call.half_closed
