"""The gRPC server's connection adapter on a recording transport: how a connection that
the peer broke ends."""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.events

from narwhal.server import http2
from narwhal.server.grpc_server import LINGER_S, GrpcConnection

from . import test_properties as properties


class Transport(properties.Transport):
    """The property tests' recording transport, with the half-close and abort a
    connection error uses."""

    def __init__(self) -> None:
        super().__init__()
        self.eof = self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.eof, "written after our end of the stream"
        super().write(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def abort(self) -> None:
        self.aborted = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


class Call(properties.Recorder):
    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.stream = stream
        self.cancelled = False

    def on_cancel(self) -> None:
        self.cancelled = True


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big")
            + payload)


REQUEST = [(":method", "POST"), (":scheme", "http"), (":authority", "x"), (":path", "/svc/M"),
           ("content-type", "application/grpc")]


def one_call(call: type[Call] = Call
             ) -> tuple[GrpcConnection, Transport, h2.connection.H2Connection, list[Call]]:
    """A connection on a recording transport with a client that opened stream 1; each
    stream's call a ``call``."""
    calls: list[Call] = []
    conn = GrpcConnection({b"/svc/M": lambda stream: calls.append(call(stream)) or calls[-1]})
    t = Transport()
    conn.transport = t  # type: ignore[assignment]
    conn.http2.initiate()
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    peer.initiate_connection()
    peer.send_headers(1, REQUEST)
    conn.data_received(peer.data_to_send())
    return conn, t, peer, calls


def test_a_connection_error_sends_goaway_then_drops_the_rest_until_the_linger_ends():
    """A GOAWAY for the peer's error is followed by our FIN, not by a close: closing with
    the peer's flood unread would make the kernel reset the connection, and the reset can
    destroy the GOAWAY before the peer reads it. The rest is dropped unparsed, and the
    socket is aborted LINGER_S later if the peer has not closed by then."""
    async def run() -> None:
        conn, t, peer, calls = one_call()
        (call,) = calls
        # A CONTINUATION with no HEADERS before it: a connection error.
        conn.data_received(frame(http2.CONTINUATION, 0, 3))
        (ended,) = [e for e in peer.receive_data(t.written)
                    if isinstance(e, h2.events.ConnectionTerminated)]
        assert ended.error_code == http2.PROTOCOL_ERROR
        assert t.eof and not t.closed and not t.aborted
        assert call.cancelled  # the connection's calls end with it, not a linger later
        sent = t.written
        call.stream.send(b"late")  # a reply that was under way: nothing follows our FIN
        conn._flush()  # what write_soon schedules
        conn.data_received(frame(http2.CONTINUATION, 0, 1) * 1000)  # parsed, it would answer
        assert t.written == sent
        assert conn.linger is not None
        assert abs(conn.linger.when() - asyncio.get_running_loop().time() - LINGER_S) < 0.5
        conn.connection_lost(None)  # the peer closed first
        assert conn.linger.cancelled()

    asyncio.run(run())


def test_open_streams_are_bounded_across_connections():
    """serving.max_streams counts streams on all of a process's connections: past it a new
    stream is answered RESOURCE_EXHAUSTED at once and no call is made for it (before, a
    peer could open 16,384 idle streams on each connection, ~2 KB of state each); a stream
    that ends, is reset, or goes with its connection gives its place back."""
    from narwhal.server.grpc_server import RESOURCE_EXHAUSTED, StreamBudget

    budget = StreamBudget(3)
    calls: list[Call] = []
    routes = {b"/svc/M": lambda stream: calls.append(Call(stream)) or calls[-1]}

    def connect() -> tuple[GrpcConnection, Transport, h2.connection.H2Connection]:
        conn = GrpcConnection(routes, budget=budget)
        t = Transport()
        conn.transport = t  # type: ignore[assignment]
        conn.http2.initiate()
        peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        peer.initiate_connection()
        return conn, t, peer

    def open_stream(conn, t, peer) -> tuple[int, list]:
        sid = peer.get_next_available_stream_id()
        peer.send_headers(sid, REQUEST)
        sent = len(t.written)
        conn.data_received(peer.data_to_send())
        return sid, peer.receive_data(t.written[sent:])

    def status(events: list, sid: int) -> int | None:
        for e in events:
            if isinstance(e, h2.events.ResponseReceived | h2.events.TrailersReceived) \
                    and e.stream_id == sid:
                found = dict(e.headers).get(b"grpc-status")
                if found is not None:
                    return int(found)
        return None

    async def run() -> None:
        a, b = connect(), connect()
        for _ in range(2):
            sid, events = open_stream(*a)
            assert status(events, sid) is None
        sid_b, events = open_stream(*b)
        assert status(events, sid_b) is None and budget.open == 3 and len(calls) == 3
        over, events = open_stream(*a)
        assert status(events, over) == RESOURCE_EXHAUSTED
        assert len(calls) == 3 and budget.open == 3 and over not in a[0].streams
        # A reset stream gives its place back.
        b[2].reset_stream(sid_b)
        b[0].data_received(b[2].data_to_send())
        assert budget.open == 2 and calls[2].cancelled
        sid, events = open_stream(*b)
        assert status(events, sid) is None and budget.open == 3
        # So does a stream that ends: the call finishes it.
        calls[-1].stream.finish()
        assert budget.open == 2
        # And every stream of a connection that goes.
        a[0].connection_lost(None)
        assert budget.open == 0

    asyncio.run(run())


def test_a_stream_silent_for_two_ticks_ends_deadline_exceeded():
    """A stream that has had neither a message nor its half-close by the connection's
    second tick (each ``preface_timeout``) ends DEADLINE_EXCEEDED, its call cancelled; a
    stream whose first message came is left alone however long it then waits."""
    from narwhal.server.grpc_server import DEADLINE_EXCEEDED

    async def run() -> None:
        calls: list[Call] = []
        conn = GrpcConnection({b"/svc/M": lambda stream: calls.append(Call(stream)) or calls[-1]},
                              preface_timeout=3600)
        t = Transport()
        conn.connection_made(t)  # type: ignore[arg-type]
        peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        peer.initiate_connection()
        for _ in range(2):
            peer.send_headers(peer.get_next_available_stream_id(), REQUEST)
        conn.data_received(peer.data_to_send())
        silent, talking = calls
        peer.send_data(3, b"\x00\x00\x00\x00\x02hi")
        conn.data_received(peer.data_to_send())
        assert talking.messages == [b"hi"]
        conn._tick()
        assert not silent.cancelled and 1 in conn.streams  # one tick: it may be just opened
        conn._tick()
        assert silent.cancelled and 1 not in conn.streams
        ended = [e for e in peer.receive_data(t.written)
                 if isinstance(e, h2.events.ResponseReceived | h2.events.TrailersReceived)]
        assert [(e.stream_id, dict(e.headers)[b"grpc-status"]) for e in ended] == [
            (1, str(DEADLINE_EXCEEDED).encode())]
        for _ in range(3):
            conn._tick()
        assert not talking.cancelled and 3 in conn.streams
        conn.connection_lost(None)
        assert conn.tick_timer is None or conn.tick_timer.cancelled()

    asyncio.run(run())


def test_a_message_in_small_frames_is_held_at_about_its_bytes():
    """A peer may send a message a few bytes a DATA frame: held as a list of the frames'
    payloads, two-byte frames took ~20x the message's bytes (the connection's receive
    window bounds the bytes, not the objects). Folded into one buffer, about its bytes;
    the message is the same."""
    import tracemalloc

    conn, _, _, calls = one_call()
    msg = b"m" * 200_000
    wire = b"\0" + len(msg).to_bytes(4, "big") + msg
    tracemalloc.start()
    for i in range(0, len(wire) - 2, 2):  # each payload a new object, as parsed frames are
        conn.data_received(frame(http2.DATA, 0, 1, wire[i:i + 2]))
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert held < 1.25 * len(wire) + 65_536, held
    (call,) = calls
    assert call.messages == []
    conn.data_received(frame(http2.DATA, http2.END_STREAM, 1, wire[len(wire) - 1:]))
    assert call.messages == [msg] and type(call.messages[0]) is bytes and call.half_closed


def test_streams_reset_before_their_first_message_end_the_connection_past_a_bound():
    """Envoy's way, a stream opened with its first message and reset once its request is
    done, never ends a connection, however many; streams reset before their first message
    (HTTP/2 rapid reset) do past PREMATURE_RESETS, when they are at least half of the
    connection's: a GOAWAY ENHANCE_YOUR_CALM, the connection's calls cancelled."""
    from narwhal.server.grpc_server import PREMATURE_RESETS

    async def run() -> None:
        conn, t, peer, calls = one_call()
        message = b"\x00\x00\x00\x00\x02hi"

        def open_stream(first_message: bool) -> int:
            sid = peer.get_next_available_stream_id()
            peer.send_headers(sid, REQUEST)
            if first_message:
                peer.send_data(sid, message)
            conn.data_received(peer.data_to_send())
            return sid

        def reset(sid: int) -> None:
            peer.reset_stream(sid)
            conn.data_received(peer.data_to_send())

        def goaway() -> list:
            return [e for e in peer.receive_data(t.written)
                    if isinstance(e, h2.events.ConnectionTerminated)]

        for _ in range(3 * PREMATURE_RESETS):
            reset(open_stream(first_message=True))
        for _ in range(PREMATURE_RESETS - 1):
            reset(open_stream(first_message=False))
        assert not goaway() and conn.linger is None
        assert all(c.cancelled for c in calls[1:]) and calls[1].messages == [b"hi"]
        held = open_stream(first_message=True)
        reset(open_stream(first_message=False))  # the 100th, but a quarter of 401 streams
        assert not goaway() and conn.linger is None
        while conn.linger is None:  # premature resets until they are half of the streams
            reset(open_stream(first_message=False))
        (ended,) = goaway()
        assert ended.error_code == http2.ENHANCE_YOUR_CALM
        assert (conn.premature, conn.opened) == (302, 604)  # half, stream 1 and 301 more
        (held_call,) = [c for c in calls if c.stream.id == held]
        assert calls[0].cancelled and held_call.cancelled  # open calls end with it
        assert held_call.messages == [b"hi"]
        conn.connection_lost(None)

    asyncio.run(run())


def test_a_call_that_raises_ends_its_own_stream_internal_and_nothing_else():
    """Whether its message came whole in one DATA frame (the token events' way, handled
    inline) or in pieces: the call's stream ends INTERNAL, the connection and its other
    calls go on."""
    class Raising(Call):
        def on_message(self, data: bytes) -> None:
            if data == b"boom":
                raise RuntimeError("a bug in a call")
            super().on_message(data)

    async def run() -> None:
        conn, t, peer, calls = one_call(Raising)  # stream 1
        for sid in (3, 5):
            peer.send_headers(sid, REQUEST)
        boom = b"\x00\x00\x00\x00\x04boom"
        peer.send_data(1, boom)  # whole, one frame
        conn.data_received(peer.data_to_send())
        peer.send_data(3, boom[:3])  # in two frames
        conn.data_received(peer.data_to_send())
        peer.send_data(3, boom[3:])
        peer.send_data(5, b"\x00\x00\x00\x00\x02ok")
        conn.data_received(peer.data_to_send())
        events = peer.receive_data(t.written)
        ended = {e.stream_id: dict(e.headers) for e in events
                 if isinstance(e, h2.events.ResponseReceived | h2.events.TrailersReceived)}
        assert ended[1][b"grpc-status"] == ended[3][b"grpc-status"] == b"13"
        assert ended[1][b"grpc-message"] == b"internal error"
        assert 5 not in ended and calls[2].messages == [b"ok"]
        assert conn.linger is None and not t.closed
        conn.connection_lost(None)

    asyncio.run(run())
