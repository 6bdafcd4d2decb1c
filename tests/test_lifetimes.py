"""A finished request is freed when its stream ends, by reference counting alone.

Driven in process through the real server stack (Narwhal's HTTP/2 and gRPC layers, the
ext_proc adapter, the driver, the exchange; an ``h2`` client in Envoy's place, the
harness of ``bench.messages``). A request whose objects form a reference cycle (a call
and its stream, a driver and its timer's callback or its adapter's send, an exchange and
its ticket's owner) outlives its last use until the cyclic collector finds it: measured,
~40 objects a request and 16-20 us a request of collections in process. So each kind of
ending below must leave nothing of Narwhal's for the collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable, Iterator

import h2.connection
import orjson
from bench.messages import (
    _headers,
    _message,
    exchange_bytes,
    open_stream,
    request_body,
    request_reads,
    setup,
    token_event,
)
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from narwhal.core.exchange import Phase
from narwhal.server.extproc import ExtProcCall
from narwhal.server.grpc_server import GrpcConnection


@contextlib.contextmanager
def cycles() -> Iterator[list[object]]:
    """Narwhal's objects made in the block that only the cyclic collector would free,
    found at its end (the collector is off inside it; what it finds is kept, then
    released). Everything alive before the block is held meanwhile: an earlier test's
    cycle that its last holder lets go of during the block is none of the block's."""
    found: list[object] = []
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    before = gc.get_objects()
    try:
        yield found
        gc.collect()
        found.extend(o for o in gc.garbage if type(o).__module__.startswith("narwhal."))
    finally:
        del before
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def send(client: h2.connection.H2Connection, sid: int, *reqs: pb.ProcessingRequest,
         end: bool = False) -> None:
    for i, req in enumerate(reqs):
        client.send_data(sid, _message(req), end_stream=end and i == len(reqs) - 1)


def request(body: bytes, stream: bool = False) -> list[pb.ProcessingRequest]:
    return [pb.ProcessingRequest(request_headers=_headers(
                {":path": "/v1/chat/completions", ":method": "POST",
                 "content-type": "application/json"})),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


def response(events: list[bytes], end: bool = True) -> list[pb.ProcessingRequest]:
    out = [pb.ProcessingRequest(response_headers=_headers(
        {":status": "200", "content-type": "text/event-stream"}))]
    out += [pb.ProcessingRequest(response_body=pb.HttpBody(body=e)) for e in events]
    if end:
        out.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"",
                                                                   end_of_stream=True)))
    return out


def phase(conn: GrpcConnection, sid: int) -> Phase | None:
    st = conn.streams.get(sid)
    call = st.call if st is not None else None
    return call.driver.ex.phase if isinstance(call, ExtProcCall) else None


def run(scenario: Callable[[GrpcConnection, object, h2.connection.H2Connection], None]
        ) -> tuple[list[object], dict[str, int]]:
    """What the collector would free, and how the scenario's requests ended."""
    async def go() -> tuple[list[object], dict[str, int]]:
        conn, transport, client, router = await setup(1)
        with cycles() as found:
            scenario(conn, transport, client)
            exchange_bytes(conn, transport, client)
            assert not conn.streams, "a stream is still open: the scenario did not end it"
        ended = {k: v for k, v in router.accounting.terminal.items() if v}
        assert router.accounting.in_flight == 0
        return found, ended
    return asyncio.run(go())


def test_whole_requests_are_freed_without_the_collector():
    def scenario(conn, transport, client) -> None:
        body = request_body()
        for _ in range(20):
            for data in request_reads(client, 8, body):
                conn.data_received(data)
            exchange_bytes(conn, transport, client)
    assert run(scenario) == ([], {"completed": 20})


def test_streams_refusals_and_cancels_are_freed_without_the_collector():
    streaming = orjson.dumps({"model": "narwhal-sim", "stream": True, "max_tokens": 8,
                              "messages": [{"role": "user", "content": "hi"}]})
    events = [token_event("a", 1), token_event("b", 2, "length") + b"data: [DONE]\n\n"]

    def scenario(conn, transport, client) -> None:
        sid = open_stream(client)  # a streamed answer, to its end
        send(client, sid, *request(streaming), *response(events), end=True)
        exchange_bytes(conn, transport, client)
        sid = open_stream(client)  # refused at once: an immediate response
        send(client, sid, *request(b'{"model": "narwhal-sim"'), end=True)
        exchange_bytes(conn, transport, client)
        sid = open_stream(client)  # the client leaves mid-answer: Envoy resets the stream
        send(client, sid, *request(streaming), *response(events[:1], end=False))
        exchange_bytes(conn, transport, client)
        client.reset_stream(sid)
        exchange_bytes(conn, transport, client)
    # the client's leaving is Envoy's to tell (its access log): cancelled until it does
    assert run(scenario) == ([], {"completed": 1, "invalid_requests": 1, "cancelled": 1})


def test_queued_requests_are_freed_without_the_collector():
    def scenario(conn, transport, client) -> None:
        body = request_body()
        # more requests than the engine's default 4 prefill slots: the rest queue, and
        # are sent from the queue as earlier ones get their first token
        reads = {}
        for _ in range(7):
            rs = request_reads(client, 8, body)
            sid = client.highest_outbound_stream_id
            for data in rs[:2]:
                conn.data_received(data)
            reads[sid] = rs[2:]
            exchange_bytes(conn, transport, client)
        assert sum(phase(conn, s) is Phase.QUEUED for s in reads) == 3
        while reads:
            for sid in [s for s in reads if phase(conn, s) is not Phase.QUEUED]:
                conn.data_received(reads[sid].pop(0))
                if not reads[sid]:
                    del reads[sid]
                exchange_bytes(conn, transport, client)
    assert run(scenario) == ([], {"completed": 7})
