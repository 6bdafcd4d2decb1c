"""The per-exchange state machine, driven the way the gRPC adapter drives it."""

from __future__ import annotations

import orjson
import pytest

from narwhal.config import parse
from narwhal.core.exchange import (
    ANSWERED_GRACE_S,
    DESTINATION_HEADER,
    Body,
    Exchange,
    Headers,
    Immediate,
    Trailers,
)
from narwhal.core.router import Router
from narwhal.server.driver import Driver, Runtime
from narwhal.sim.generate import SimOptions, make_plan, stream_events

BODY = orjson.dumps({"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 4})
HDRS = {":path": "/v1/chat/completions", ":method": "POST"}


def ready_router(serving: dict | None = None, **config: dict) -> Router:
    r = Router(parse({"serving": serving or {}, **config,
                      "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]}))
    for e in r.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = r.clock()
    r.started = True
    return r


@pytest.fixture
def router() -> Router:
    return ready_router({"max_request_bytes": 1000})


def engine_stream(body: bytes, fault: str | None = None) -> bytes:
    up = orjson.loads(body)
    # named after one request ID (Envoy's x-request-id), so that two streams of the same
    # body are the same bytes
    plan = make_plan(up, SimOptions(), fault, None, "exchange-test")
    return b"".join(data for _, data in stream_events(plan))


def admit(ex: Exchange, body: bytes = BODY) -> bytes:
    assert ex.request_headers(HDRS, False) == []  # held until the body is sized
    h, b = ex.request_body(body, True)
    assert isinstance(h, Headers) and isinstance(b, Body) and b.end_of_stream
    assert (DESTINATION_HEADER, "127.0.0.1:9") in h.set and h.destination == "127.0.0.1:9"
    assert ("content-length", str(len(b.data))) in h.set
    return b.data


def test_non_streaming_round_trip_counts_completed(router):
    ex = Exchange(router)
    up = admit(ex)
    assert orjson.loads(up)["stream"] is True
    assert ex.request.body == {"model": "narwhal-sim"}  # sent: not held parsed to its end
    assert ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False) == []
    sse = engine_stream(up)
    actions = []
    for i in range(0, len(sse), 7):  # arbitrary chunking
        actions += ex.response_body(sse[i:i + 7], False)
    actions += ex.response_body(b"", True)
    h, b = actions
    assert ("content-type", "application/json") in h.set
    resp = orjson.loads(b.data)
    assert resp["usage"]["completion_tokens"] == 4
    assert ("content-length", str(len(b.data))) in h.set
    ex.close()
    assert router.accounting.terminal["completed"] == 1 and router.accounting.in_flight == 0
    assert router.engines[0].in_flight == 0 and router.engines[0].output_tokens == 4


def test_streaming_round_trip_forwards_events(router):
    ex = Exchange(router)
    up = admit(ex, orjson.dumps(orjson.loads(BODY) | {"stream": True}))
    (h,) = ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    assert "content-length" in h.remove
    out = b""
    for part in engine_stream(up).split(b"\n\n"):
        for a in ex.response_body(part + b"\n\n", False):
            out += a.data
    out += b"".join(a.data for a in ex.response_body(b"", True))
    assert out.endswith(b"data: [DONE]\n\n") and b'token_ids":[' not in out
    assert b'"token_ids":null' in out  # hidden as vLLM hides them: null, not absent
    assert b"usage" not in out  # the client did not ask for it


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("kept", "whole"), [(-1, True), (-2, True), (3, False), (0, False)])
def test_an_answer_ending_without_done_is_whole_only_with_its_finish_reason(stream, kept, whole):
    """The engine's body ends cleanly after ``kept`` of its events (-1: all but
    ``[DONE]``; -2: nor the usage event, so the last is the finish_reason's): with the
    finish_reason the answer is whole (a stream gets the ``[DONE]`` the engine left out);
    without it the answer was cut short, counted failed, and the client told so."""
    router = ready_router({"max_request_bytes": 1000})
    ex = Exchange(router)
    up = admit(ex, orjson.dumps(orjson.loads(BODY) | {"stream": stream}))
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    actions = []
    for event in engine_stream(up).split(b"\n\n")[:-1][:kept]:
        actions += ex.response_body(event + b"\n\n", False)
    actions += ex.response_body(b"", True)
    ex.close()
    assert router.accounting.terminal["completed" if whole else "failed"] == 1
    assert router.engines[0].in_flight == 0 and router.held_bytes == 0
    last = actions[-1]
    if stream:
        assert isinstance(last, Body) and last.end_of_stream
        assert last.data.endswith(b"data: [DONE]\n\n") is whole
        assert (b"ended before its answer did" in last.data) is not whole
    elif whole:
        assert orjson.loads(last.data)["choices"][0]["finish_reason"] == "length"
    else:
        assert isinstance(last, Immediate) and last.error.status == 502
        assert "ended before its answer did" in last.error.message


@pytest.mark.parametrize("held", [False, True])
def test_an_event_nested_too_deep_to_write_is_the_engines_fault(held):
    """orjson reads 1,024 levels and writes 254. A streaming client's events are written
    again when Narwhal hides the token IDs it asked for (and the final one is held for the
    usage frame's metadata): an event nested 300 deep raised orjson's TypeError out of the
    exchange, a 500 'internal router error'. It is the engine's malformed output: the
    client's error event names it, the request counts failed, nothing stays held."""
    router = ready_router({"max_request_bytes": 1000})
    ex = Exchange(router)
    admit(ex, orjson.dumps(orjson.loads(BODY) | {"stream": True}))
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    deep = b"[" * 300 + b"]" * 300
    first = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[5]}]}\n\n'
    final = (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop","token_ids":[],'
             b'"x_extra":' + deep + b'}]}\n\n')
    if not held:
        first = first.replace(b'"token_ids"', b'"x_extra":' + deep + b',"token_ids"')
    out = b"".join(a.data for a in ex.response_body(first, False))
    out += b"".join(a.data for a in ex.response_body(final + b"data: [DONE]\n\n", True))
    ex.close()
    assert out.endswith(b'"engine event nested deeper than 254 levels","type":"upstream_error",'
                        b'"param":null,"code":"bad_engine_response"}}\n\n')
    assert (b'"content":"a"' in out) is held  # the tokens before it reached the client
    assert router.accounting.terminal["failed"] == 1 and router.accounting.in_flight == 0
    assert router.engines[0].in_flight == 0 and router.held_bytes == 0


def test_redelivered_final_chunk_is_ignored(router):
    ex = Exchange(router)
    admit(ex)
    assert ex.request_body(BODY, True) == []


def test_413_mid_body_without_content_length(router):
    ex = Exchange(router)
    ex.request_headers(HDRS, False)
    assert ex.request_body(b"x" * 600, False) == []
    (imm,) = ex.request_body(b"x" * 600, False)
    assert isinstance(imm, Immediate) and imm.error.status == 413
    assert router.accounting.terminal["invalid_requests"] == 1
    assert router.accounting.unsized_offered == 1


def test_a_body_in_too_many_small_pieces_is_a_400_that_releases_everything():
    """Past 1,024 pieces each must bring 64 bytes of the body on average (each piece is an
    ext_proc message of its own): 1-byte pieces end the request at the 1,041st (17 past
    the free ones, 1,088 bytes due, 1,041 come), counted invalid."""
    router = ready_router()
    ex = Exchange(router)
    ex.request_headers(HDRS, False)
    for _ in range(1040):
        assert ex.request_body(b" ", False) == []
    (imm,) = ex.request_body(b" ", False)
    assert isinstance(imm, Immediate) and imm.error.status == 400
    assert imm.error.code == "request_body_fragmented" and "1041 pieces" in imm.error.message
    assert ex.request_body(b" ", False) == []  # what Envoy had already sent: nothing more
    ex.close()
    acct = router.accounting
    assert acct.terminal["invalid_requests"] == 1 and acct.in_flight == 0
    assert router.held_bytes == 0


def test_a_body_in_many_pieces_of_fair_size_is_served():
    """A client writing its body 100 bytes at a time: 2,000 pieces, admitted whole (open
    admission: the long prompt's projection is not what is tested)."""
    r = ready_router(admission={"mode": "open"})
    body = orjson.dumps({"model": "narwhal-sim", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "x" * (200_000 - 80)}]})
    ex = Exchange(r)
    ex.request_headers(HDRS, False)
    out: list = []
    for at in range(0, len(body), 100):
        out += ex.request_body(body[at:at + 100], at + 100 >= len(body))
    assert ex.request_pieces == 2000
    h, *bodies = out
    assert isinstance(h, Headers) and h.destination == "127.0.0.1:9"
    sent = orjson.loads(b"".join(b.data for b in bodies))
    assert sent["messages"] == orjson.loads(body)["messages"]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("size", "whole"), [(1, False), (40, True)])
def test_an_engine_answer_in_too_many_small_pieces_is_failed(stream, size, whole):
    """Past 1,024 pieces each piece of an engine's answer must bring 32 bytes on average:
    an answer written a byte at a time ends at the 1,058th piece (34 past the free ones,
    1,088 bytes due, 1,058 come), failed like any broken engine output, everything
    released; the same answer in 40-byte pieces (~1,900 of them) is served whole."""
    router = ready_router()
    ex = Exchange(router)
    up = admit(ex, orjson.dumps(orjson.loads(BODY) | {"stream": stream, "max_tokens": 300}))
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    sse = engine_stream(up)
    out: list = []
    for at in range(0, len(sse), size):
        out += ex.response_body(sse[at:at + size], at + size >= len(sse))
        if ex.terminal is not None:
            break
    ex.close()
    assert router.accounting.terminal["completed" if whole else "failed"] == 1
    assert router.engines[0].in_flight == 0 and router.held_bytes == 0
    if whole:
        assert len(sse) > 1024 * size
        return
    assert at == 1057  # the 1,058th piece
    said = out[-1].data if stream else out[-1].error.body()
    assert b"pieces of under 32 bytes on average (past the first 1024 pieces)" in said


@pytest.mark.parametrize("piece,count,status", [(b" ", 1041, 400), (b"x" * 500, 3, 413)])
def test_a_pass_through_body_is_bounded_as_a_completions(piece, count, status):
    """``GET /v1/models`` with a body: relayed piece by piece, within the same bounds (bytes,
    and pieces past 1,024), and ended by the error past them."""
    router = ready_router({"max_request_bytes": 1000 if status == 413 else 1_048_576})
    ex = Exchange(router)
    (h,) = ex.request_headers({":path": "/v1/models", ":method": "GET"}, False)
    assert isinstance(h, Headers) and h.destination == "127.0.0.1:9"
    for _ in range(count - 1):
        (b,) = ex.request_body(piece, False)
        assert isinstance(b, Body) and b.data == piece
    (imm,) = ex.request_body(piece, False)
    assert isinstance(imm, Immediate) and imm.error.status == status
    assert ex.request_body(piece, True) == []
    ex.close()
    assert router.accounting.in_flight == 0 and router.accounting.offered == 0


def test_413_from_content_length(router):
    (imm,) = Exchange(router).request_headers(HDRS | {"content-length": "1001"}, False)
    assert imm.error.code == "request_too_large"


def test_client_gone_before_body_end_is_unsized_and_cancelled(router):
    ex = Exchange(router)
    ex.request_headers(HDRS, False)
    ex.request_body(b"{", False)
    ex.close()
    acct = router.accounting
    assert acct.terminal["cancelled"] == 1 and acct.unsized_offered == 1 and acct.in_flight == 0


def test_no_healthy_engine_is_503(router):
    router.engines[0].healthy = False
    ex = Exchange(router)
    ex.request_headers(HDRS, False)
    (imm,) = ex.request_body(BODY, True)
    assert imm.error.status == 503 and imm.error.code == "backend_unavailable"
    assert imm.error.retry_after == 1
    assert router.accounting.terminal["unavailable"] == 1


def test_standby_router_refuses(router):
    router.config = parse({"router": {"role": "standby"}})
    router.scheduler.config = router.config
    (imm,) = Exchange(router).request_headers(HDRS, False)
    assert imm.error.status == 503 and ("retry-after", "1") in imm.error.headers()


@pytest.mark.parametrize(("fault", "says"), [("bool-token-id", "Boolean token ID"),
                                             ("overrun", "5 output token IDs, past the "
                                                         "request's max_tokens (4)")])
def test_token_id_fault_non_streaming_is_502_and_marks_engine(router, fault, says):
    ex = Exchange(router)
    up = admit(ex)
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    (imm,) = ex.response_body(engine_stream(up, fault), False)
    assert imm.error.status == 502 and router.engines[0].measurement_failures == 1
    assert says in imm.error.message
    assert ex.response_body(b"data: more\n\n", True) == []
    assert router.accounting.terminal["failed"] == 1


def test_engine_error_status_is_passed_through_when_it_is_an_envelope(router):
    ex = Exchange(router)
    admit(ex)
    assert ex.response_headers({":status": "400"}, False) == []
    err = b'{"error": {"message": "too long", "type": "BadRequestError"}}'
    h, b = ex.response_body(err, True)
    assert b.data == err and router.accounting.terminal["invalid_requests"] == 1


def test_engine_error_status_without_envelope_is_502(router):
    ex = Exchange(router)
    admit(ex)
    ex.response_headers({":status": "503"}, False)
    (imm,) = ex.response_body(b"upstream connect error", True)
    assert imm.error.status == 502


def test_passthrough_route_echoes_bodies(router):
    ex = Exchange(router)
    (h,) = ex.request_headers({":path": "/v1/models", ":method": "GET"}, True)
    assert h.destination == "127.0.0.1:9"
    assert ex.response_headers({":status": "200"}, False) == [Headers(True)]
    (b,) = ex.response_body(b"{}", True)
    assert b.data == b"{}" and router.engines[0].in_flight == 0
    assert router.accounting.offered == 0


def test_assembled_response_is_bounded(router):
    router.config = parse({"serving": {"max_response_bytes": 2000},
                           "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]})
    router.scheduler.config = router.config
    ex = Exchange(router)
    up = admit(ex, orjson.dumps(orjson.loads(BODY) | {"max_tokens": 64}))
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    (imm,) = ex.response_body(engine_stream(up), False)
    assert imm.error.status == 502 and "max_response_bytes" in imm.error.message


def test_engine_that_does_not_stream_is_502(router):
    ex = Exchange(router)
    admit(ex)
    (imm,) = ex.response_headers({":status": "200", "content-type": "application/json"}, False)
    assert imm.error.status == 502 and "application/json" in imm.error.message
    assert router.accounting.terminal["failed"] == 1 and router.engines[0].in_flight == 0


def test_request_trailers_end_the_body(router):
    ex = Exchange(router)
    assert ex.request_headers(HDRS, False) == []
    assert ex.request_body(BODY, False) == []
    h, b, t = ex.request_trailers()
    assert isinstance(h, Headers) and isinstance(b, Body) and isinstance(t, Trailers)
    assert not b.end_of_stream and orjson.loads(b.data)["stream"] is True


def test_trailers_of_a_queued_request_are_answered_after_its_body():
    """A body ended by trailers whose request waits (in the queue, or for its prompt to be
    measured): Envoy takes the replies in order, so the trailers' reply follows the body
    sent upstream, not the trailers' arrival."""
    router = one_slot_router()
    runtime = Runtime(router, NoTimers())
    first, second = [], []
    d1, d2 = Driver(runtime, first.extend), Driver(runtime, second.extend)
    d1.step(d1.ex.request_headers, HDRS, False)
    d1.step(d1.ex.request_body, BODY, True)
    d2.step(d2.ex.request_headers, HDRS, False)
    d2.step(d2.ex.request_body, BODY, False)
    d2.step(d2.ex.request_trailers)
    assert [type(a) for a in first] == [Headers, Body] and second == []
    d1.closed()  # frees the slot: the queue sends the second, then its trailers' reply
    h, b, t = second
    assert isinstance(h, Headers) and isinstance(b, Body) and isinstance(t, Trailers)
    assert not b.end_of_stream


REFUSAL = (b'data: {"error":{"message":"too many logprobs","type":"BadRequestError",'
           b'"param":"logprobs","code":400}}\n\ndata: [DONE]\n\n')


def test_engine_refusal_in_stream_keeps_status_for_non_streaming(router):
    """vLLM opens the stream, then refuses (top_logprobs > 20): the client gets vLLM's 400."""
    ex = Exchange(router)
    admit(ex)
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    (imm,) = ex.response_body(REFUSAL, True)
    assert isinstance(imm, Immediate) and imm.error.status == 400
    assert orjson.loads(imm.error.body())["error"] == {
        "message": "too many logprobs", "type": "BadRequestError", "param": "logprobs",
        "code": 400}
    assert router.accounting.terminal["invalid_requests"] == 1
    assert router.accounting.in_flight == 0 and router.engines[0].in_flight == 0


def test_engine_refusal_in_stream_relayed_to_streaming_client(router):
    ex = Exchange(router)
    admit(ex, orjson.dumps(orjson.loads(BODY) | {"stream": True}))
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    (body,) = ex.response_body(REFUSAL, False)
    assert body.end_of_stream and body.data == REFUSAL
    assert router.accounting.terminal["invalid_requests"] == 1


def test_engine_error_after_tokens_is_a_failure(router):
    ex = Exchange(router)
    up = admit(ex, orjson.dumps(orjson.loads(BODY) | {"stream": True}))
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    ex.response_body(engine_stream(up).split(b"\n\n")[1] + b"\n\n", False)  # one token
    (body,) = ex.response_body(REFUSAL, False)
    assert b"upstream_error" in body.data and b"[DONE]" not in body.data
    assert router.accounting.terminal["failed"] == 1


def test_echo_is_not_asked_for_token_ids(router):
    ex = Exchange(router)
    ex.request_headers({":path": "/v1/completions", ":method": "POST"}, False)
    h, b = ex.request_body(orjson.dumps({"model": "narwhal-sim", "prompt": "hi", "echo": True}),
                           True)
    assert "return_token_ids" not in orjson.loads(b.data)


@pytest.mark.parametrize("header", ["x-request-timeout-ms", "x-slo-ttft-ms"])
@pytest.mark.parametrize("value", ["\u00b2", "1\u00b2", "\u0663", "", "-5", "0", "1e3", "0.0",
                                   ".5", "1.", "1.2345", "1.2.3", "1.-5", "1.\u00b2", "+1"])
def test_millisecond_headers_accept_ascii_digits_only(router, header, value):
    (imm,) = Exchange(router).request_headers(HDRS | {header: value}, False)
    assert imm.error.status == 400 and imm.error.param == header
    assert router.held == 0 and router.accounting.in_flight == 0


@pytest.mark.parametrize(("value", "ms"), [("250", 250), ("0.5", 0.5), (" 2.25 ", 2.25),
                                          ("7.125", 7.125), ("60000.5", 60_000),
                                          ("9" * 40 + ".5", 60_000)])
def test_millisecond_headers_take_decimal_milliseconds(router, value, ms):
    ex = Exchange(router)
    ex.request_headers(HDRS | {"x-slo-ttft-ms": value, "x-slo-tpot-ms": value}, False)
    assert ex.budget_s == pytest.approx(ms / 1000)
    assert ex.tpot_budget_s == pytest.approx(ms / 1000)


def test_millisecond_headers_clamp(router):
    adm = router.config.admission
    ex = Exchange(router)
    ex.request_headers(HDRS | {"x-slo-ttft-ms": "9" * 5000, "x-request-timeout-ms": "99999999999"},
                       False)
    assert ex.budget_s == adm.max_ttft_target_ms / 1000
    assert ex.deadline - ex.arrival == pytest.approx(adm.request_timeout_ms / 1000)


@pytest.mark.parametrize("length", ["\u00b2", "9" * 5000])
def test_content_length_never_crashes(router, length):
    out = Exchange(router).request_headers(HDRS | {"content-length": length}, False)
    assert out == [] or out[0].error.status == 413


def test_second_request_headers_on_one_stream_is_ignored(router):
    ex = Exchange(router)
    assert ex.request_headers(HDRS, False) == []
    assert ex.request_headers(HDRS, False) == []
    acct = router.accounting
    assert acct.offered == 1 and router.held == 1 and acct.in_flight == 1
    ex.close()
    assert router.held == 0 and acct.in_flight == 0 and acct.balanced()


def test_in_flight_is_counted_not_derived(router):
    ex = Exchange(router)
    ex.request_headers(HDRS, False)
    acct = router.accounting
    assert acct.in_flight == 1 and acct.balanced()
    acct.terminal["completed"] += 1  # a terminal counted without its exchange ending
    assert not acct.balanced()


def test_too_deep_body_is_a_400(router):
    ex = Exchange(router)
    ex.request_headers(HDRS, False)
    deep = b'{"model": "narwhal-sim", "messages": [{"role": "user", "content": "x"}], "x": ' + \
        b"[" * 300 + b"]" * 300 + b"}"
    (imm,) = ex.request_body(deep, True)
    assert imm.error.status == 400 and "deeper" in imm.error.message


class NoTimers:
    def call_later(self, delay, callback):
        return self

    def cancel(self):
        pass


def ready(r: Router) -> Router:
    for e in r.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = r.clock()
    r.started = True
    return r


def one_slot_router(**serving) -> Router:
    """Open admission to one engine with one prefill and one decode slot: a second
    request waits in the queue until the first ends."""
    return ready(Router(parse({"admission": {"mode": "open"}, "serving": serving,
                               "scheduler": {"max_prefill_per_engine": 1,
                                             "max_decode_per_engine": 1},
                               "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]})))


def test_failure_at_queue_dispatch_stays_in_its_request(monkeypatch):
    """A request failing when the queue places it must not raise into the turn that
    freed the slot (another exchange's), and must not harm that exchange."""
    router = one_slot_router()
    runtime = Runtime(router, NoTimers())
    first, second = [], []
    d1, d2 = Driver(runtime, first.extend), Driver(runtime, second.extend)
    for d in (d1, d2):
        d.step(d.ex.request_headers, HDRS, False)
        d.step(d.ex.request_body, BODY, True)
    assert [type(a) for a in first] == [Headers, Body] and second == []

    def boom(self):
        raise RuntimeError("bug")

    monkeypatch.setattr(Exchange, "_upstream", boom)
    d1.closed()  # frees the slot: the queue places the second, which fails alone
    (imm,) = second
    assert imm.error.status == 500
    assert router.accounting.terminal["failed"] == 1
    assert router.accounting.terminal["cancelled"] == 1 and router.dispatched == []


def test_a_body_slower_than_its_timeout_is_refused_408():
    """A client that sends its headers and then its body a few bytes at a time: refused
    once serving.request_body_timeout_ms has passed since its headers (before, it held its
    retention slot and its bytes until the request's deadline, 600 s). A body that comes
    in time is served; a client deadline sooner than the body timeout is a 504, as any
    deadline before response headers."""
    now = [100.0]
    router = ready(Router(parse({"serving": {"request_body_timeout_ms": 2000},
                                 "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]}),
                          clock=lambda: now[0]))
    slow = Exchange(router)
    assert slow.request_headers(HDRS, False) == []
    assert slow.wake_at == pytest.approx(102.0)
    assert slow.request_body(BODY[:10], False) == []
    now[0] = 101.0
    assert slow.expire() == [] and slow.wake_at == pytest.approx(102.0)  # early: again later
    assert slow.request_body(BODY[10:20], False) == []
    assert router.held == 1 and router.held_bytes == 20
    now[0] = 102.0
    (imm,) = slow.expire()
    assert isinstance(imm, Immediate)
    assert imm.error.status == 408 and imm.error.code == "request_body_timeout"
    assert router.held == 0 and router.held_bytes == 0 and slow.wake_at is None
    assert router.accounting.terminal["expired"] == 1 and router.accounting.unsized_offered == 1
    assert slow.request_body(BODY[20:], True) == []  # the rest comes too late: nothing

    in_time = Exchange(router)
    in_time.request_headers(HDRS, False)
    in_time.request_body(BODY[:10], False)
    now[0] = 103.9
    actions = in_time.request_body(BODY[10:], True)
    assert isinstance(actions[0], Headers)  # sent upstream
    assert in_time.wake_at == pytest.approx(in_time.deadline)  # the body timeout is over

    hurried = Exchange(router)
    hurried.request_headers(HDRS | {"x-request-timeout-ms": "1000"}, False)
    assert hurried.wake_at == pytest.approx(now[0] + 1.0)
    now[0] = hurried.wake_at
    (imm,) = hurried.expire()
    assert imm.error.status == 504 and imm.error.code == "terminal_expiry"


def stall_router(clock) -> Router:
    return ready(Router(parse({"serving": {"engine_stall_timeout_ms": 1000},
                               "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]}),
                        clock=clock))


def responding(stream: bool) -> tuple[list[float], Router, Exchange, list[bytes]]:
    """A request on ``stall_router`` (1 s stall timeout) whose engine has sent its role
    event and first token; its clock, router, exchange and the engine's events."""
    now = [100.0]
    router = stall_router(lambda: now[0])
    ex = Exchange(router)
    up = admit(ex, orjson.dumps(orjson.loads(BODY) | {"stream": stream}))
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    first = engine_stream(up).split(b"\n\n")
    ex.response_body(first[0] + b"\n\n" + first[1] + b"\n\n", False)
    return now, router, ex, first


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("ending", ["body end", "grace", "close"])
def test_after_done_nothing_is_read_and_the_answer_ends_whole(stream, ending):
    """[DONE] ends the answer (``Phase.ANSWERED``): events after it, in its chunk or
    later, are neither relayed nor counted. The request completes when the engine's body
    ends, or ANSWERED_GRACE_S after [DONE] if it stays open (it ended as engine_stalled,
    failed, a stall timeout later; a stream's client got an error event after [DONE]), or,
    for a stream whose client has [DONE], when the client closes first (it counted
    cancelled: the openai client closes at [DONE])."""
    now, router, ex, events = responding(stream)
    late = events[2] + b"\n\n"  # a token event after [DONE]: not part of the answer
    assert events[-2:] == [b"data: [DONE]", b""]
    out = [a for e in events[2:-2] for a in ex.response_body(e + b"\n\n", False)]
    out += ex.response_body(b"data: [DONE]\n\n" + late, False)
    assert ex.wake_at == pytest.approx(now[0] + ANSWERED_GRACE_S)  # not the stall timeout
    out += ex.response_body(late, False)
    if ending == "body end":
        out += ex.response_body(late, True)
    elif ending == "grace":
        now[0] += ANSWERED_GRACE_S / 2
        assert ex.expire() == [] and ex.terminal is None  # woken early: asks again
        now[0] = ex.wake_at
        out += ex.expire()
    else:
        ex.close()
    if ending != "close" or stream:
        assert router.accounting.terminal["completed"] == 1
        assert router.engines[0].output_tokens == 4 and router.engines[0].in_flight == 0
    if stream:
        data = b"".join(a.data for a in out)
        assert data.count(b"data: [DONE]") == 1 and data.endswith(b"data: [DONE]\n\n")
        assert data.count(b'"content"') == 3  # tokens 2-4 (the first went before), once each
        assert ending == "close" or out[-1].end_of_stream
    elif ending != "close":
        headers, body = out[-2:]
        assert isinstance(headers, Headers) and body.end_of_stream
        assert orjson.loads(body.data)["usage"]["completion_tokens"] == 4
    ex.close()
    assert router.accounting.in_flight == 0 and router.held_bytes == 0


def assert_stalled(actions: list, stream: bool) -> None:
    if stream:
        (body,) = actions
        assert body.end_of_stream and b"engine_stalled" in body.data
    else:
        (imm,) = actions
        assert imm.error.status == 504 and imm.error.code == "engine_stalled"


@pytest.mark.parametrize("stream", [True, False])
def test_a_stalled_engine_fails_the_request_and_frees_its_slot(stream):
    """The exchange says when it wants to be woken (``wake_at``); woken early, it asks
    again for later; woken after the stall, it fails the request."""
    now, router, ex, first = responding(stream)
    assert router.engines[0].decode == 1
    armed = ex.wake_at
    assert armed is not None
    now[0] += 0.6
    ex.response_body(first[2] + b"\n\n", False)  # activity: the stall clock restarts
    assert ex.wake_at == armed  # lazily: tokens cost no timer work
    now[0] = armed
    assert ex.expire() == []  # 0.6 s of silence only: asks again for later
    assert ex.wake_at == pytest.approx(100.6 + 1.0)
    now[0] = ex.wake_at
    assert_stalled(ex.expire(), stream)
    assert ex.wake_at is None
    assert router.accounting.terminal["failed"] == 1
    assert router.engines[0].in_flight == 0 and router.accounting.in_flight == 0


@pytest.mark.parametrize("stream", [True, False])
def test_bytes_without_output_are_no_progress(stream):
    """After its first tokens the engine sends only SSE comments (a proxy's keepalives), an
    event without tokens and the start of an event it never finishes, each within the
    stall timeout of the last: none restarts the stall clock, and the request fails when
    the timeout has passed since its last token (before: each restarted it, and such an
    engine held the request and its slot for as long as max_response_bytes lasted)."""
    now, router, ex, first = responding(stream)
    last_token = now[0]
    assert router.engines[0].decode == 1
    empty = orjson.loads(first[1][6:])
    for choice in empty["choices"]:
        choice.pop("token_ids", None)
        for field in ("delta", "text", "logprobs"):
            if field in choice:
                choice[field] = {} if field == "delta" else None if field == "logprobs" else ""
    idle = [b": keepalive\n\n", b"data: " + orjson.dumps(empty) + b"\n\n"] * 2
    for chunk in [*idle, b"data: {\"id\""]:
        now[0] += 0.25
        assert all(not a.end_of_stream for a in ex.response_body(chunk, False))
    assert router.engines[0].decode == 1  # still held: nothing ended it yet
    now[0] = ex.wake_at
    assert now[0] == pytest.approx(last_token + 1.0)
    assert_stalled(ex.expire(), stream)
    assert router.accounting.terminal["failed"] == 1
    assert router.engines[0].in_flight == 0 and router.accounting.in_flight == 0


@pytest.mark.parametrize("stream", [True, False])
def test_before_its_first_token_a_request_is_not_stalled_within_its_ttft_budget(stream):
    """A 5 s TTFT budget against a 1 s stall timeout: the engine's queue may hold the
    first token that long (admission projected it), so the silence after the response
    headers fails the request only once the budget has run out too; after the first
    token the stall timeout alone counts again."""
    now = [100.0]
    router = ready(Router(parse({"serving": {"engine_stall_timeout_ms": 1000},
                                 "admission": {"ttft_target_ms": 5000},
                                 "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]}),
                          clock=lambda: now[0]))
    body = orjson.dumps(orjson.loads(BODY) | {"stream": stream})
    silent = Exchange(router)
    admit(silent, body)
    now[0] = 100.2
    silent.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    assert silent.wake_at == pytest.approx(105.0)  # not 101.2
    now[0] = 104.9
    assert silent.expire() == []
    now[0] = silent.wake_at
    actions = silent.expire()
    assert actions and b"engine_stalled" in (actions[0].data if stream else
                                               actions[0].error.body())
    assert router.engines[0].in_flight == 0

    answered = Exchange(router)
    up = admit(answered, body)
    answered.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    now[0] += 3.0  # 3 s in the engine's queue: past the stall timeout, within the budget
    assert answered.expire() == []
    first = engine_stream(up).split(b"\n\n")
    answered.response_body(first[0] + b"\n\n" + first[1] + b"\n\n", False)
    assert answered.ticket.first_token_at == now[0]
    # re-armed at the first token: the budget's wait is over, the stall timeout counts
    assert answered.wake_at == pytest.approx(now[0] + 1.0)
    now[0] = answered.wake_at  # silent for the stall timeout after its first token
    assert answered.expire()
    assert router.accounting.terminal["failed"] == 2


@pytest.mark.parametrize("stream", [True, False])
def test_before_its_first_token_a_request_waits_while_its_engine_answers_others(stream):
    """Open admission lets an engine's queue outgrow any budget: a request silent before
    its first token is no stall while the engine answers others (a token from it within
    the stall timeout), up to its own deadline; an engine silent to everyone for the
    stall timeout is stalled."""
    now = [100.0]
    router = ready(Router(parse({"serving": {"engine_stall_timeout_ms": 1000},
                                 "admission": {"mode": "open", "ttft_target_ms": 500,
                                               "request_timeout_ms": 60_000},
                                 "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]}),
                          clock=lambda: now[0]))
    sse = {":status": "200", "content-type": "text/event-stream"}
    busy = Exchange(router)
    # room for the ~140 token events it is fed below (one of them again and again)
    up = admit(busy, orjson.dumps(orjson.loads(BODY) | {"stream": True, "max_tokens": 200}))
    busy.response_headers(sse, False)
    tokens = [e + b"\n\n" for e in engine_stream(up).split(b"\n\n") if e][1:]
    busy.response_body(tokens.pop(0), False)  # its first token: the engine is at work

    def waiting_exchange() -> Exchange:
        ex = Exchange(router)
        admit(ex, orjson.dumps(orjson.loads(BODY) | {"stream": stream}))
        ex.response_headers(sse, False)
        return ex

    waiting = waiting_exchange()
    for _ in range(20):  # 10 s in the engine's queue while the other request streams
        now[0] += 0.5
        busy.response_body(tokens.pop(0), False)
        if waiting.wake_at is not None and waiting.wake_at <= now[0]:
            assert waiting.expire() == []
    assert waiting.terminal is None
    assert waiting.wake_at is not None and waiting.wake_at <= now[0] + 1.0
    now[0] = waiting.wake_at  # the engine silent to everyone for the stall timeout
    actions = waiting.expire()
    assert actions and b"engine_stalled" in (actions[0].data if stream else
                                               actions[0].error.body())

    router.engines[0].telemetry_at = now[0]  # (nothing scrapes here)
    late = waiting_exchange()  # at most until its deadline, however busy the engine
    while now[0] < late.deadline - 0.5:
        now[0] += 0.5
        busy.response_body(tokens[0], False)  # the same token event again: it counts
        if late.wake_at is not None and late.wake_at <= now[0]:
            assert late.expire() == []
    assert late.terminal is None
    now[0] = late.wake_at
    assert late.wake_at == pytest.approx(late.deadline)
    actions = late.expire()
    assert actions and b"engine_stalled" in (actions[0].data if stream else
                                               actions[0].error.body())
    assert router.accounting.terminal["failed"] == 2


def test_close_mid_response_frees_slots_now_and_counts_when_envoy_says(router):
    ex = Exchange(router)
    up = admit(ex, orjson.dumps(orjson.loads(BODY) | {"stream": True}))
    ex.request_id = "rid-1"
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    ex.response_body(engine_stream(up).split(b"\n\n")[1] + b"\n\n", False)
    router.closes.wait_s = 1.0
    ex.close()
    assert router.closes.wake_at() == pytest.approx(router.clock() + 1.0, abs=0.5)
    acct = router.accounting
    assert router.engines[0].in_flight == 0 and router.held == 0  # released at once
    assert acct.in_flight == 1 and acct.balanced()  # the terminal waits for the verdict
    router.closes.logged("rid-1", "failed")
    assert acct.terminal["failed"] == 1 and acct.in_flight == 0 and acct.balanced()


def test_empty_subset_hint_is_503(router):
    ex = Exchange(router)
    ex.request_headers(HDRS, False, subset=[])
    (imm,) = ex.request_body(BODY, True)
    assert imm.error.status == 503 and imm.error.code == "backend_unavailable"


def test_subset_hint_limits_placement(router):
    ex = Exchange(router)
    ex.request_headers(HDRS, False, subset=["10.9.9.9:1", "127.0.0.1:9"])
    h, _ = ex.request_body(BODY, True)
    assert h.destination == "127.0.0.1:9"


def test_large_bodies_go_in_chunks_within_envoys_limit(router):
    ex = Exchange(router)
    ex.request_headers(HDRS, False)
    big = orjson.dumps({"model": "narwhal-sim", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "x" * 150_000}]})
    router.config = parse({"serving": {"max_request_bytes": 1_000_000},
                           "admission": {"mode": "open"},
                           "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]})
    router.scheduler.config = router.config
    h, *bodies = ex.request_body(big, True)
    assert all(len(b.data) <= 62_000 for b in bodies) and len(bodies) == 3
    assert [b.end_of_stream for b in bodies] == [False, False, True]
    assert ("content-length", str(sum(len(b.data) for b in bodies))) in h.set


def test_a_large_body_is_held_as_its_bytes_while_queued_and_not_at_all_once_sent():
    """Parsed, 1 MiB of small messages takes ~10 MiB, and up to the retention limit's
    requests are held: a queued request over 16 KiB (PARK_BYTES) keeps the client's bytes and is
    parsed again to go (the same upstream body as one sent at once); once sent, what is
    held is its facts and its model."""
    import tracemalloc

    router = one_slot_router(max_request_bytes=4_000_000)
    runtime = Runtime(router, NoTimers())
    big = orjson.dumps({"model": "narwhal-sim", "max_tokens": 4, "temperature": 0.5,
                        "messages": [{"role": "user", "content": "x"}] * 30_000})
    assert len(big) > 20 * 16_384
    first, second, third = [], [], []
    drivers = [Driver(runtime, out.extend) for out in (first, second, third)]
    tracemalloc.start()
    for d, body in zip(drivers, (big, big, BODY), strict=True):
        d.step(d.ex.request_headers, HDRS, False)
        d.step(d.ex.request_body, body, True)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    sent = b"".join(a.data for a in first if isinstance(a, Body))
    assert orjson.loads(sent)["messages"] == orjson.loads(big)["messages"]
    assert held < 4 * len(big)  # parsed, the two would be ~20x it
    one, two, small = (d.ex for d in drivers)
    assert one.request.body == {"model": "narwhal-sim"} and one.parked is None  # sent
    assert two.request.body == {"model": "narwhal-sim"} and two.parked == big  # queued
    assert small.request.body == orjson.loads(BODY) and small.parked is None  # small: parsed
    assert small.held_bytes == 10 * len(BODY)  # counted as a parsed body may take
    drivers[0].closed()  # frees the slot: the queue sends the second, parsed again
    assert b"".join(a.data for a in second if isinstance(a, Body)) == sent
    assert two.parked is None and two.request.body == {"model": "narwhal-sim"}
    assert two.request.max_tokens == 4 and not two.request.stream


def test_a_small_queued_body_stays_parsed_only_where_the_budget_has_room():
    """A queued body under 16 KiB stays parsed (no second parse to go), up to ~10x its
    bytes (~160 KiB; 256 queued: 40 MiB, counted nowhere): counted so now, and held as its
    bytes instead where the process's budget has no room for that."""
    router = one_slot_router(max_request_bytes=1000, max_response_bytes=1000,
                             max_held_bytes=1200)  # room for one parsed
    runtime = Runtime(router, NoTimers())
    drivers = [Driver(runtime, lambda _: None) for _ in range(3)]
    for d in drivers:
        d.step(d.ex.request_headers, HDRS, False)
        d.step(d.ex.request_body, BODY, True)
    _, parsed, parked = (d.ex for d in drivers)
    assert parsed.parked is None and parsed.held_bytes == 10 * len(BODY)
    assert parked.parked == BODY and parked.held_bytes == len(BODY)
    assert router.held_bytes == sum(d.ex.held_bytes for d in drivers)
    drivers[0].closed()  # the parsed one goes, its parsed share given back
    assert parsed.phase.name == "UPSTREAM" and parsed.held_bytes == parsed.ticket.held()


def held_router(**serving) -> Router:
    return ready(Router(parse({
        "serving": {"max_request_bytes": 1000, "max_response_bytes": 2000,
                    "max_held_bytes": 2000, **serving},
        "admission": {"mode": "open"},
        "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]})))


def test_request_bodies_are_held_within_the_process_budget():
    """A client can hold bodies open (a slow upload each): within serving.max_held_bytes,
    not past the process's memory. Past it a new body is a capacity rejection (429,
    Retry-After), and what a request held is given back when its body is sent or it ends."""
    router = held_router()
    part = b'{"model": "narwhal-sim", "max_tokens": 4, "messages": [{"role": "user", "content": "'
    part += b"x" * (700 - len(part))
    first, second, third = (Exchange(router) for _ in range(3))
    for ex in (first, second):
        ex.request_headers(HDRS, False)
        assert ex.request_body(part, False) == []
    assert router.held_bytes == 1400
    third.request_headers(HDRS, False)
    (imm,) = third.request_body(part, False)
    assert isinstance(imm, Immediate) and imm.error.status == 429
    assert imm.error.code == "held_bytes_full" and imm.error.retry_after == 1
    assert router.accounting.terminal["rejected"] == 1 and router.held_bytes == 1400
    h, *_ = first.request_body(b'"}]}', True)  # sent upstream: its bytes are given back
    hashes = first.ticket.held()  # but for its prompt's hashes (the prefix index's)
    assert isinstance(h, Headers) and 10 * 44 > hashes >= 9 * 44
    assert router.held_bytes == 700 + hashes == second.held_bytes + first.held_bytes
    second.close()  # a client gone mid-body gives its bytes back too
    assert router.held_bytes == hashes
    again = Exchange(router)
    again.request_headers(HDRS, False)
    assert again.request_body(part, False) == [] and router.held_bytes == 700 + hashes
    first.close()
    assert router.held_bytes == 700


def test_a_body_in_small_chunks_is_held_at_about_its_bytes():
    """A client that sends its body a few bytes at a time (Envoy forwards each read as a
    chunk) is counted at its bytes; held as a list of chunks, two-byte chunks took ~22x
    them, and 64-byte chunks (the smallest average a body past 1,024 pieces may have)
    ~1.6x. Folded into one buffer: about its bytes, and the same request goes upstream."""
    import tracemalloc

    router = held_router(max_request_bytes=300_000, max_held_bytes=400_000,
                         max_response_bytes=300_000)
    body = orjson.dumps({"model": "narwhal-sim", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "ab" * 100_000}]})
    ex = Exchange(router)
    ex.request_headers(HDRS, False)
    tracemalloc.start()
    for i in range(0, len(body), 64):  # each chunk a new object, as each message's is
        assert ex.request_body(body[i:i + 64], False) == []
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert router.held_bytes == len(body) and held < 1.25 * len(body) + 16_384, held
    h, *bodies = ex.request_body(b"", True)
    sent = orjson.loads(b"".join(b.data for b in bodies))
    assert isinstance(h, Headers) and sent["messages"][0]["content"] == "ab" * 100_000


def test_a_prompts_hashes_count_in_the_process_budget_until_its_end():
    """The prefix index's hashes of a prompt are held from admission to the request's end
    (its reply extends them): 44 bytes a 64-byte block, 692 KB for a 1 MB prompt
    (measured), counted nowhere until now, past the bodies the budget was for. Counted
    with the request: a body that fits but not with its hashes is refused 429."""
    import tracemalloc

    from narwhal.core.prefix import prompt_blocks
    from narwhal.core.scheduler import BLOCK_HELD

    body = {"model": "m", "messages": [{"role": "user", "content": "word " * 20_000}]}
    tracemalloc.start()
    blocks = prompt_blocks(body)[0]
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert 0.8 * held < BLOCK_HELD * len(blocks) < 1.25 * held, (held, len(blocks))

    router = held_router(max_held_bytes=1600, max_response_bytes=1000)
    part = b'{"model": "narwhal-sim", "max_tokens": 4, "messages": [{"role": "user", "content": "'
    whole = part + b"x" * (700 - len(part)) + b'"}]}'
    upstream = []
    for _ in range(2):
        ex = Exchange(router)
        ex.request_headers(HDRS, False)
        h, *_ = ex.request_body(whole, True)
        assert isinstance(h, Headers) and ex.held_bytes == ex.ticket.held() == 9 * BLOCK_HELD
        upstream.append(ex)
    assert router.held_bytes == 2 * 9 * BLOCK_HELD  # 792 of 1,600
    third = Exchange(router)
    third.request_headers(HDRS, False)
    (imm,) = third.request_body(whole, True)  # 704 bytes fit; with its 396 of hashes, not
    assert isinstance(imm, Immediate) and imm.error.code == "held_bytes_full"
    assert router.held_bytes == sum(ex.held_bytes for ex in upstream)
    for ex in upstream:
        ex.close()
    assert router.held_bytes == 0


def test_an_assembly_past_the_process_budget_ends_its_request_alone():
    """Non-streaming responses are held until assembled: one that would pass
    serving.max_held_bytes ends 503 (Retry-After), another request's held bytes stay
    counted, and the budget is whole again once both end."""
    router = held_router(max_held_bytes=2500, max_response_bytes=2500)
    waiting = Exchange(router)
    waiting.request_headers(HDRS, False)
    waiting.request_body(b'{"model": "narwhal-sim", "messages": [' + b" " * 800, False)
    ex = Exchange(router)
    admit(ex)
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    event = orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": "y" * 400},
                                                  "token_ids": [7]}]})
    out = []
    for _ in range(5):
        out = ex.response_body(b"data: " + event + b"\n\n", False)
        if out:
            break
    (imm,) = out
    assert isinstance(imm, Immediate) and imm.error.status == 503
    assert imm.error.code == "held_bytes_full" and imm.error.retry_after == 1
    assert router.accounting.terminal["failed"] == 1
    assert router.held_bytes == waiting.held_bytes > 800
    waiting.close()
    assert router.held_bytes == 0


def test_an_event_still_being_received_counts_in_the_process_budget():
    """The SSE parser holds an event until its end (up to serving.max_event_bytes): an
    engine sending partial events to many streams holds that much; counted with the rest,
    past the budget it ends its request (an error event for a stream), alone."""
    router = held_router(max_held_bytes=2500, max_response_bytes=2500)
    waiting = Exchange(router)
    waiting.request_headers(HDRS, False)
    waiting.request_body(b'{"model": "narwhal-sim", "messages": [' + b" " * 900, False)
    ex = Exchange(router)
    admit(ex, orjson.dumps({"model": "narwhal-sim", "stream": True, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hi"}]}))
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    assert ex.response_body(b'data: {"choices": [' + b" " * 900, False) == []
    assert waiting.held_bytes > 900 and ex.held_bytes > 900
    assert router.held_bytes == waiting.held_bytes + ex.held_bytes
    (body,) = ex.response_body(b" " * 700, False)
    assert isinstance(body, Body) and body.end_of_stream and b"held_bytes_full" in body.data
    assert router.accounting.terminal["failed"] == 1
    assert router.held_bytes == waiting.held_bytes


def test_a_streamed_replys_text_counts_in_the_process_budget():
    """A stream keeps its reply's text for the prefix index (up to 64 Ki characters) until
    it ends: those bytes count against serving.max_held_bytes with the rest, are given back
    at its end, and past the budget end the stream (an error event), alone."""
    stream = orjson.dumps({"model": "narwhal-sim", "stream": True, "max_tokens": 4000,
                           "messages": [{"role": "user", "content": "hi"}]})

    def token(i: int) -> bytes:
        return b"data: " + orjson.dumps({"id": "c", "choices": [
            {"index": 0, "delta": {"content": "abcdefgh"}, "token_ids": [i]}]}) + b"\n\n"

    router = held_router(max_held_bytes=20_000)
    ex = Exchange(router)
    admit(ex, stream)
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    for i in range(100):
        (relayed,) = ex.response_body(token(i), False)
        assert b'"abcdefgh"' in relayed.data
    assert router.held_bytes == ex.held_bytes >= ex.reply.held > 800
    ex.response_body(b"data: [DONE]\n\n", True)
    assert router.held_bytes == 0 and router.accounting.terminal["completed"] == 1
    greedy = Exchange(router)
    admit(greedy, stream)
    greedy.response_headers({":status": "200", "content-type": "text/event-stream"}, False)
    out = []
    for i in range(4000):
        out = greedy.response_body(token(i), False)
        if out[-1].end_of_stream:
            break
    assert b"held_bytes_full" in out[-1].data and router.accounting.terminal["failed"] == 1
    assert 1500 < i < 2500 and router.held_bytes == 0  # ~15 KB of text in ~20 KB


class Words:
    """A stand-in tokenizer, a token a word. With ``gate`` (a ``threading.Event``), a long
    text's tokenizing waits until the gate opens: the tokenizer's work on a long prompt,
    held for as long as the test needs."""

    def __init__(self, gate=None) -> None:
        self.gate = gate

    def encode_batch(self, texts, add_special_tokens=False):
        from types import SimpleNamespace

        if self.gate is not None and len(texts[0]) > 4096:
            assert self.gate.wait(30)
        return [SimpleNamespace(ids=list(range(len(t.split())))) for t in texts]


def tokenizing_router(tokenizer, clock=None) -> Router:
    router = ready(Router(parse({"admission": {"mode": "open"},
                                 "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]}),
                          **({} if clock is None else {"clock": clock})))
    router.sizer.tokenizer = router.scheduler.tokenizer = tokenizer  # sizing.tokenizer's
    return router


LONG = orjson.dumps({"model": "narwhal-sim", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "narwhal tusk " * 1000}]})


def test_a_long_prompt_is_measured_off_the_loop_then_admitted():
    """With a tokenizer, a long prompt's tokenizing (0.5-0.8 s for 1 MB here, inline on the
    event loop: every stream in the process stopped) is work the exchange leaves for the
    adapter (``Router.measuring``): ``measure`` is pure, ``measured`` admits. A short
    prompt is measured inline; a request that ends meanwhile ignores its measurement."""
    from narwhal.core.exchange import Phase

    now = [100.0]
    router = tokenizing_router(Words(), lambda: now[0])
    ex = Exchange(router)
    ex.request_headers(HDRS, False)
    assert ex.request_body(LONG, True) == [] and ex.phase is Phase.MEASURING
    assert router.take_measuring() == [ex] and router.held_bytes == len(LONG)
    m = ex.measure()
    assert m.tokens == 2000 and m.prompt.blocks  # a token a word; its blocks in tokens
    h, *bodies = ex.measured(m)
    assert isinstance(h, Headers) and b"narwhal tusk" in b"".join(b.data for b in bodies)
    assert ex.ticket.tokens == 2000 and ex.ticket.block_units == 16
    short = Exchange(router)
    short.request_headers(HDRS, False)
    assert [type(a) for a in short.request_body(BODY, True)] == [Headers, Body]
    assert router.measuring == []
    gone = Exchange(router)  # its client leaves while its prompt is measured
    gone.request_headers(HDRS, False)
    gone.request_body(LONG, True)
    gone.close()
    assert gone.measured(gone.measure()) == [] and gone.terminal == "cancelled"
    late = Exchange(router)  # its deadline passes while its prompt is measured
    late.request_headers(HDRS | {"x-request-timeout-ms": "1000"}, False)
    late.request_body(LONG, True)
    now[0] += 1.0
    (imm,) = late.expire()
    assert imm.error.status == 504 and late.measured(late.measure()) == []
    assert router.accounting.terminal["expired"] == 1
    ex.close()
    short.close()
    assert router.held == 0 and router.held_bytes == 0


def test_tokenizing_a_long_prompt_leaves_the_event_loop_serving():
    """Through the adapter, on an event loop: while a long prompt's tokenizer is held in
    its thread, another request is admitted and sent on the loop; once the tokenizer
    returns, the long one is admitted and sent."""
    import asyncio
    import threading

    from narwhal.server.driver import in_thread

    async def run() -> None:
        loop = asyncio.get_running_loop()
        gate = threading.Event()
        router = tokenizing_router(Words(gate))
        runtime = Runtime(router, loop, in_thread(loop))
        long_sent: list = []
        sent_long = asyncio.Event()

        def send(actions: list) -> None:
            long_sent.extend(actions)
            if actions:
                sent_long.set()

        long = Driver(runtime, send)
        long.step(long.ex.request_headers, HDRS, False)
        long.step(long.ex.request_body, LONG, True)
        other_sent: list = []
        other = Driver(runtime, other_sent.extend)
        other.step(other.ex.request_headers, HDRS, False)
        other.step(other.ex.request_body, BODY, True)
        assert [type(a) for a in other_sent] == [Headers, Body] and long_sent == []
        gate.set()
        await asyncio.wait_for(sent_long.wait(), 30)
        assert isinstance(long_sent[0], Headers) and long.ex.ticket.tokens == 2000

    asyncio.run(run())
