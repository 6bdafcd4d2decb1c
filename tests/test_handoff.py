"""serving.workers without processes: the scheduler's side of a worker link (``WorkerPort``)
fed ext_proc messages, the exchange it hands over rebuilt from msgpack on a second router
(the worker's), driven there, and what the worker reports fed back. The scheduler must
end up exactly where one process ends up for the same exchange."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from narwhal.config import parse
from narwhal.core.exchange import Action, Body, Exchange, Headers
from narwhal.core.handoff import resume
from narwhal.core.router import Router
from narwhal.server import workers as w
from narwhal.server.driver import Runtime
from narwhal.server.grpc_server import GrpcConnection

from .test_exchange import BODY, admit, engine_stream

STREAM_BODY = orjson.dumps(orjson.loads(BODY) | {"stream": True,
                                                 "stream_options": {"include_usage": True}})
EVENT_STREAM = {":status": "200", "content-type": "text/event-stream"}


def make_router() -> Router:
    r = Router(parse({"engines": [{"name": "a", "url": "http://127.0.0.1:9"}]}))
    for e in r.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = r.clock()
    r.started = True
    return r


class FakeLink:
    """Collects the frames a side sends, as the other side will decode them."""

    def __init__(self) -> None:
        self.frames: list[list[Any]] = []

    def send(self, frame: tuple[Any, ...]) -> None:
        self.frames.append(msgspec.msgpack.decode(msgspec.msgpack.encode(frame)))

    def take(self) -> list[list[Any]]:
        out, self.frames = self.frames, []
        return out


class NoTimers:
    def call_later(self, delay: float, callback: Any) -> Any:
        class Handle:
            def cancel(self) -> None:
                pass
        return Handle()


def request_messages(body: bytes) -> list[bytes]:
    hdrs = base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key="x-request-id", raw_value=b"rid-7")])
    return [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hdrs)).SerializeToString(),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
            .SerializeToString()]


class Pair:
    """A scheduler (router + WorkerPort with a fake link) and a worker's router whose
    Control reports over another fake link."""

    def __init__(self) -> None:
        self.sched = make_router()
        self.port = w.WorkerPort(Runtime(self.sched, NoTimers()), 0)
        self.to_worker = FakeLink()
        self.port.link = self.to_worker  # type: ignore[assignment]
        self.worker = make_router()
        self.to_sched = FakeLink()
        self.control = w.RemoteControl(self.worker, self.to_sched,  # type: ignore[arg-type]
                                       lambda n, p: self.worker.engines[0])
        self.worker.control = self.control

    def forward(self, sid: int, body: bytes) -> tuple[list[Any], list[bytes]]:
        """The worker forwards a request's messages; returns the handoff and the replies."""
        for i, raw in enumerate(request_messages(body)):
            self.port.on_frame([w.W_MSG if i else w.W_OPEN, sid, raw])
        frames = self.to_worker.take()
        handoffs = [f[2] for f in frames if f[0] == w.S_HANDOFF]
        assert len(handoffs) == 1 and frames[0][0] == w.S_HANDOFF  # before the replies
        return handoffs[0], [f[2] for f in frames if f[0] == w.S_SEND]

    def take_over(self, sid: int, snap: list[Any]) -> Exchange:
        ex = resume(self.worker, snap, lambda n, p: self.worker.engines[0])
        self.control.sids[ex] = sid
        return ex

    def report(self) -> None:
        for frame in self.to_sched.take():
            self.port.on_frame(frame)


def drive_stream(ex: Exchange, up: bytes) -> bytes:
    out = b""
    for a in ex.response_headers(EVENT_STREAM, False):
        assert isinstance(a, Headers)
    for part in engine_stream(up).split(b"\n\n"):
        out += b"".join(a.data for a in ex.response_body(part + b"\n\n", False)
                        if isinstance(a, Body))
    out += b"".join(a.data for a in ex.response_body(b"", True) if isinstance(a, Body))
    return out


def assemble(p: Pair, sid: int) -> tuple[Exchange, list[Action]]:
    """A non-streaming request forwarded, handed to the worker, and its whole engine
    stream answered there in one chunk: the worker's exchange (its stream still open)
    and its actions for that chunk."""
    snap, _ = p.forward(sid, BODY)
    ex = p.take_over(sid, snap)
    ex.response_headers(EVENT_STREAM, False)
    upstream = orjson.loads(BODY) | {"stream": True, "return_token_ids": True,
                                      "stream_options": {"include_usage": True}}
    return ex, ex.response_body(engine_stream(orjson.dumps(upstream)), True)


def in_loop(fn: Any) -> Any:
    """WorkerPort wants a running loop (its hello future)."""
    async def run() -> Any:
        return fn()
    return asyncio.run(run())


def test_handed_over_stream_ends_where_one_process_ends():
    def body() -> None:
        p = Pair()
        snap, replies = p.forward(1, STREAM_BODY)
        assert len(replies) == 2  # the request headers' and the rewritten body's
        ex = p.take_over(1, snap)
        one = make_router()  # the same exchange in one process, for comparison
        ex1 = Exchange(one)
        up = admit(ex1, STREAM_BODY)
        out = drive_stream(ex, up)
        out1 = drive_stream(ex1, up)
        ex.close()
        ex1.close()
        assert out == out1 and out.endswith(b"data: [DONE]\n\n") and b'"usage"' in out
        # Before the reports, the scheduler still holds the request.
        assert p.sched.engines[0].in_flight == 1 and p.sched.held == 1
        p.report()
        for r in (p.sched, one):
            acct, e = r.accounting, r.engines[0]
            assert acct.terminal["completed"] == 1 and acct.in_flight == 0 and acct.balanced()
            assert r.held == 0 and e.in_flight == 0 and e.output_tokens == 4 and e.completed == 1
            assert r.learning.errors  # the first token was learned from
        assert p.port.calls == {}  # nothing kept for it
        assert p.worker.accounting.offered == 0  # the worker counts nothing itself

    in_loop(body)


def test_a_worker_reports_each_engine_step_to_the_scheduler_not_each_token():
    """The scheduler's step model times the engine's steps from their first tokens: a
    worker sends a token that follows a pause of more than 2 ms (one frame a step), not
    the tokens of the same step, and the scheduler's model measures the step."""
    def body() -> None:
        p = Pair()
        snap, _ = p.forward(5, STREAM_BODY)
        ex = p.take_over(5, snap)
        t0 = 1000.0
        for dt, first in ((0.0, True), (0.0005, False), (0.0015, False), (0.030, False),
                          (0.0305, False), (0.060, False), (0.059, False)):
            p.control.token(ex, t0 + dt, first)
        sent = [(round(f[2] - t0, 4), f[3]) for f in p.to_sched.frames if f[0] == w.W_TOKEN]
        assert sent == [(0.0, True), (0.03, False), (0.06, False)]
        model = p.sched.engines[0].model
        assert model.step_model.summary()["steps"] == 0
        p.report()
        # The prompt dispatched before the first step was computed in it: a step length.
        assert model.step_model.summary()["steps"] == 1
        assert model.last_step_at == t0 + 0.060
        p.port.on_frame([w.W_TOKEN, 5, t0 + 0.0595, False])  # another worker's, read late
        assert model.last_step_at == t0 + 0.060  # a step already seen: no step, no rewind
        assert model.step_model.summary()["steps"] == 1
        ex.close()

    in_loop(body)


def test_non_streaming_assembly_runs_in_the_worker():
    def body() -> None:
        p = Pair()
        ex, (h, b) = assemble(p, 3)
        assert isinstance(b, Body)
        assert orjson.loads(b.data)["usage"]["completion_tokens"] == 4
        ex.close()
        p.report()
        assert p.sched.accounting.terminal["completed"] == 1 and p.sched.held == 0

    in_loop(body)


def test_stream_gone_before_the_handoff_arrives_closes_on_the_scheduler():
    def body() -> None:
        p = Pair()
        p.forward(5, STREAM_BODY)  # handed off, but the worker's stream ended meanwhile
        p.port.on_frame([w.W_CLOSE, 5])
        acct = p.sched.accounting
        assert p.sched.engines[0].in_flight == 0 and p.sched.held == 0
        p.sched.closes.expire(p.sched.clock() + 60)  # no verdict from Envoy: cancelled
        assert acct.terminal["cancelled"] == 1 and acct.in_flight == 0 and acct.balanced()

    in_loop(body)


@pytest.mark.parametrize("verdict", ["failed", "cancelled"])
def test_worker_close_mid_response_waits_for_envoys_verdict_on_the_scheduler(verdict):
    def body() -> None:
        p = Pair()
        snap, _ = p.forward(9, STREAM_BODY)
        ex = p.take_over(9, snap)
        ex.response_headers(EVENT_STREAM, False)
        up = orjson.loads(STREAM_BODY) | {"return_token_ids": True}
        ex.response_body(engine_stream(orjson.dumps(up)).split(b"\n\n")[1] + b"\n\n", False)
        ex.close()
        p.sched.closes.wait_s = 1.0
        p.report()
        acct = p.sched.accounting
        assert p.sched.engines[0].in_flight == 0 and p.sched.held == 0  # released at once
        assert acct.in_flight == 1  # the terminal waits for Envoy's access log
        p.port.on_frame([w.W_VERDICT, "rid-7", verdict])
        assert acct.terminal[verdict] == 1 and acct.in_flight == 0 and acct.balanced()

    in_loop(body)


def test_refusal_is_answered_by_the_scheduler_and_never_handed_off():
    def body() -> None:
        p = Pair()
        p.sched.engines[0].healthy = False
        for i, raw in enumerate(request_messages(STREAM_BODY)):
            p.port.on_frame([w.W_MSG if i else w.W_OPEN, 2, raw])
        frames = p.to_worker.take()
        assert [f[0] for f in frames] == [w.S_SEND, w.S_FINISH]
        reply = pb.ProcessingResponse.FromString(frames[0][2])
        assert reply.immediate_response.status.code == 503
        assert p.port.calls == {} and p.sched.accounting.in_flight == 0

    in_loop(body)


def test_the_rest_of_a_stream_the_scheduler_ended_opens_nothing():
    def body() -> None:
        p = Pair()
        p.sched.started = False  # not ready: refused at its headers
        headers, rest = request_messages(STREAM_BODY)
        p.port.on_frame([w.W_OPEN, 4, headers])
        assert [f[0] for f in p.to_worker.take()] == [w.S_SEND, w.S_FINISH]
        p.port.on_frame([w.W_MSG, 4, rest])  # forwarded before the worker heard
        p.port.on_frame([w.W_CLOSE, 4])
        assert p.port.calls == {} and p.to_worker.take() == []
        assert not p.port.runtime.live  # nothing kept for it
        acct = p.sched.accounting
        assert acct.offered == 1 and acct.in_flight == 0 and acct.balanced()

    in_loop(body)


def test_a_worker_that_dies_between_release_and_count_leaves_nothing_uncounted():
    def body() -> None:
        p = Pair()
        assemble(p, 6)
        release = [f for f in p.to_sched.take() if f[0] != w.W_COUNT]  # the count is lost
        for frame in release:
            p.port.on_frame(frame)
        acct = p.sched.accounting
        assert acct.in_flight == 1 and p.sched.held == 0
        p.port.lost()
        assert acct.terminal["completed"] == 1 and acct.in_flight == 0 and acct.balanced()
        assert p.port.calls == {}

    in_loop(body)


class FakeTransport:
    def __init__(self) -> None:
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return False


def test_a_full_link_holds_envoys_connections_until_it_drains():
    def body() -> None:
        link = w.Link(lambda f: None, lambda: None)
        worker = w.Worker(parse({}), 0, link)
        conn = GrpcConnection({})
        conn.transport = FakeTransport()  # type: ignore[assignment]
        worker.watch(conn)
        link.pause_writing()  # the scheduler is not keeping up
        assert not conn.transport.reading
        conn.resume_writing()  # its own socket drained: still held by the link
        assert not conn.transport.reading
        late = GrpcConnection({})
        late.transport = FakeTransport()  # type: ignore[assignment]
        worker.watch(late)  # a connection that arrives meanwhile waits too
        assert not late.transport.reading
        link.resume_writing()
        assert conn.transport.reading and late.transport.reading

    in_loop(body)
