"""A single-threaded gRPC server on asyncio, for the ext_proc hot path.

Why not grpcio here: measured with this project's benchmark (README, "Performance"),
grpc.aio's floor is ~55 µs of CPU per ext_proc message round trip even with an echo
servicer, because every message crosses three threads (the EventEngine I/O thread,
the completion-queue poller, the asyncio loop), and a paced token stream sends one
message per token. Here HTTP/2 is the sans-I/O ``http2.ServerConnection``, messages
stay xds-protos (upb) protobufs, and everything runs on the event loop that already
holds the router state: no thread handoffs, one socket write per read.

Scope is what Envoy's gRPC client uses: unary and streaming calls over h2c with prior
knowledge, identity encoding, status in trailers. Message size is bounded
(RESOURCE_EXHAUSTED past it), so is what a peer can make a connection hold (see
``Stream``) and the streams open across connections (``StreamBudget``); a stream must
bring its first message, and a connection its HTTP/2 preface, in time (``_tick``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from collections.abc import Callable
from typing import Protocol, TypeVar

from ..core import pieces
from . import http2

log = logging.getLogger("narwhal.grpc")
M = TypeVar("M")  # a protobuf message class's instances (``Stream.decode``)

# gRPC status codes used here.
OK = 0
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13

RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
MAX_MESSAGE = 4 * 1024 * 1024  # gRPC's own default receive limit
_MESSAGE_HEAD = struct.Struct(">BI").pack  # a message's prefix: compressed flag, length
_LENGTH = struct.Struct(">I").unpack_from  # a message's length, from its prefix
OUT_HIGH = 1024 * 1024  # a stream's held-back output above which its input waits
WRITE_HIGH = 4 * 1024 * 1024  # the socket's send buffer above which nothing more is read
# After a GOAWAY for the peer's error, how long its remaining input is read and dropped
# before the socket closes: closing with input unread makes the kernel send a reset, which
# can reach the peer before the GOAWAY and destroy it (nginx's lingering close, bounded).
LINGER_S = 1.0
PREMATURE_RESETS = 100  # streams reset before their first message: see ``_reset``
PREFACE_TIMEOUT_S = 10.0  # a connection must speak HTTP/2 within this


class Call(Protocol):
    """One RPC on a connection; the server feeds it decoded messages."""

    def on_message(self, data: bytes) -> None: ...

    def on_half_close(self) -> None: ...

    def on_cancel(self) -> None: ...


class Stream:
    """Per-stream framing state plus the send side handed to the call.

    Inbound bytes wait as a list of pieces (joined once a whole message is there, so
    reassembly is linear) and are returned to the connection window only when delivered;
    outbound frames that flow control holds back wait as a list too. While a stream's
    output is held back beyond ``OUT_HIGH`` bytes, its input is not delivered: a peer
    that does not read cannot make the stream hold more than the connection window.
    """

    __slots__ = ("conn", "id", "parts", "buffered", "call", "headers_sent", "closed",
                 "pending", "pending_size", "trailers", "half_closed", "idle_ticks")

    def __init__(self, conn: GrpcConnection, stream_id: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.parts: list[bytes] = []
        self.buffered = 0
        self.call: Call | None = None
        self.headers_sent = False
        self.closed = False
        self.pending: deque[bytes] = deque()
        self.pending_size = 0
        self.trailers: list[tuple[bytes, bytes]] = []
        self.half_closed = False
        # Ticks of the connection's timer (``GrpcConnection._tick``) passed before the
        # call's first message or half-close; -1 once one came.
        self.idle_ticks = 0

    def send(self, message: bytes) -> None:
        if self.closed:
            return
        if not self.headers_sent:
            self.conn.http2.send_headers(self.id, RESPONSE_HEADERS)
            self.headers_sent = True
        frame = _MESSAGE_HEAD(0, len(message)) + message  # uncompressed, its length
        if not self.pending:
            sent = self.conn.http2.send_data(self.id, frame)
            if sent == len(frame):
                return
            frame = frame[sent:]
        self.pending.append(frame)  # the HTTP/2 connection wakes the stream for it
        self.pending_size += len(frame)

    def decode(self, kind: type[M], data: bytes) -> M | None:
        """``data`` as a ``kind`` message, or None with the call ended INVALID_ARGUMENT: a
        peer's undecodable message fails its own stream alone. (The ext_proc calls decode
        inline instead: they close their exchange before the stream, on the hot path.)"""
        try:
            return kind.FromString(data)  # type: ignore[attr-defined]
        except Exception:  # upb raises its own DecodeError type
            self.finish(INVALID_ARGUMENT, f"undecodable {kind.__name__}")
            return None

    def finish(self, status: int = OK, message: str = "") -> None:
        """End the call with trailers, after any data still waiting for window."""
        if self.closed:
            return
        self.closed = True
        trailers = [(b"grpc-status", str(status).encode())]
        if message:
            trailers.append((b"grpc-message", message.encode("ascii", "replace")))
        self.trailers = trailers
        if not self.headers_sent:
            self.conn.http2.send_headers(self.id, RESPONSE_HEADERS + trailers, end_stream=True)
            self.conn.drop(self)
            return
        self.conn.flush(self)


class StreamBudget:
    """Open streams across a process's connections, against ``serving.max_streams``.
    Why: HTTP/2 bounds streams per connection (16,384 each), and each open stream holds
    its call's state (~2 KB: an idle ext_proc stream's exchange, driver and framing), so
    a peer that opens streams and sends nothing on them held up to 16,384 x
    ``serving.max_connections`` of them (32 GB at the defaults)."""

    __slots__ = ("limit", "open")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0


class GrpcConnection(asyncio.Protocol):
    """One HTTP/2 connection from Envoy; routes each stream to a call factory by path."""

    def __init__(self, routes: dict[bytes, Callable[[Stream], Call]],
                 max_message: int = MAX_MESSAGE,
                 on_lost: Callable[[GrpcConnection], None] | None = None,
                 preface_timeout: float = PREFACE_TIMEOUT_S, refuse: bool = False,
                 budget: StreamBudget | None = None) -> None:
        self.routes = routes
        self.max_message = max_message
        self.on_lost = on_lost
        self.preface_timeout = preface_timeout
        self.refuse = refuse
        self.budget = budget
        self.transport: asyncio.Transport | None = None
        self.http2 = http2.ServerConnection()
        self.streams: dict[int, Stream] = {}
        self.opened = 0  # streams the peer opened on this connection
        self.premature = 0  # of them, reset by the peer before a message or half-close
        self.flush_scheduled = False
        self.tick_timer: asyncio.TimerHandle | None = None
        self.write_paused = False  # our send buffer to this peer is full
        self.held = False  # what this peer's input feeds is full (a worker's link)
        self.linger: asyncio.TimerHandle | None = None  # closing after an error's GOAWAY

    # -- asyncio.Protocol --------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        if self.refuse:  # over the connection limit
            transport.abort()  # type: ignore[attr-defined]
            return
        self.transport.set_write_buffer_limits(high=WRITE_HIGH)
        self.tick_timer = asyncio.get_running_loop().call_later(
            self.preface_timeout, self._tick)
        self.http2.initiate()
        self._write()

    def _tick(self) -> None:
        """Every ``preface_timeout``: a connection that has not spoken HTTP/2 by the first
        tick is aborted (it holds nothing); after it, a stream that has had neither a
        message nor its half-close for two ticks ends ``DEADLINE_EXCEEDED``. Envoy writes
        a call's first message as it opens it (an ext_proc request's headers, a health
        check, an access log's entries): an open, silent stream only holds a place
        within ``serving.max_streams``. One timer a connection, no clock read a stream."""
        self.tick_timer = None
        if self.transport is None or self.transport.is_closing() or self.linger is not None:
            return
        if not self.http2.preface:
            self.transport.abort()  # a peer that never speaks HTTP/2 holds nothing
            return
        for st in [st for st in self.streams.values() if st.idle_ticks >= 0]:
            st.idle_ticks += 1
            if st.idle_ticks >= 2 and st.call is not None:
                self._fail(st, DEADLINE_EXCEEDED, "no message on the stream in time")
        self._write()
        self.tick_timer = asyncio.get_running_loop().call_later(
            self.preface_timeout, self._tick)

    def pause_writing(self) -> None:
        """The socket's send buffer is over its high-water mark: read nothing more from
        this peer (whose input makes our output) until it drains."""
        self.write_paused = True
        self._sync_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._sync_reading()

    def hold(self, on: bool) -> None:
        """Read nothing more from this peer while ``on``: where its input goes next (a
        worker's link to the scheduler) is full."""
        self.held = on
        self._sync_reading()

    def _sync_reading(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if self.write_paused or self.held:
            t.pause_reading()
        else:
            t.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.linger is not None:
            return  # the connection is over: the peer's remaining input is dropped
        for ev in self.http2.receive(data):
            cls = ev.__class__
            if cls is http2.DataReceived:
                self._data(ev)
            elif cls is http2.RequestReceived:
                self._request(ev)
            elif cls is http2.StreamReset:
                if self._reset(ev.stream_id):
                    return
            elif cls is http2.WindowUpdated:
                self._unblock(ev.stream_id)
            elif cls is http2.ConnectionTerminated:
                self._write()
                if ev.code:
                    log.warning("closing HTTP/2 connection: %s", ev.message)
                    self._linger()
                else:
                    self.transport.close()
                return
        self._write()

    def _linger(self) -> None:
        """End our side after the GOAWAY (a FIN behind it) and drop what the peer still
        sends until it closes or LINGER_S passes, so that the GOAWAY is read, not reset.
        The connection's calls end now, as if it were lost: nothing more is written."""
        t = self.transport
        self.linger = asyncio.get_running_loop().call_later(LINGER_S, t.abort)
        if t.can_write_eof():
            t.write_eof()
        t.resume_reading()  # whatever paused it, the rest is only dropped now
        self._cancel_all()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.linger is not None:
            self.linger.cancel()
        if self.tick_timer is not None:
            self.tick_timer.cancel()
        self._cancel_all()
        if self.on_lost is not None:
            self.on_lost(self)

    # -- streams -----------------------------------------------------------------
    def _request(self, ev: http2.RequestReceived) -> None:
        headers = dict(ev.headers)
        st = Stream(self, ev.stream_id)
        self.streams[ev.stream_id] = st
        self.opened += 1
        budget = self.budget
        if budget is not None:
            budget.open += 1
            if budget.open > budget.limit:  # answered at once; no call is made for it
                st.finish(RESOURCE_EXHAUSTED,
                          f"serving.max_streams ({budget.limit}) streams are open")
                return
        factory = self.routes.get(headers.get(b":path", b""))
        if factory is None:
            st.finish(UNIMPLEMENTED, "unknown method")
        elif headers.get(b"grpc-encoding", b"identity") != b"identity":
            st.finish(UNIMPLEMENTED, "only identity encoding is supported")
        else:
            st.call = factory(st)
            st.half_closed = ev.end_stream
            self._deliver(st)

    def _data(self, ev: http2.DataReceived) -> None:
        st = self.streams.get(ev.stream_id)
        if st is None or st.call is None:
            self.http2.consumed(len(ev.data))
            return
        data = ev.data
        if not st.parts and not st.pending_size and len(data) > 5 and data[0] == 0:
            # The common case, one whole message in one DATA frame: no buffering.
            n = _LENGTH(data, 1)[0]
            if len(data) == 5 + n and n <= self.max_message:
                self.http2.consumed(5 + n)
                st.idle_ticks = -1
                try:  # ``_call``, inline: every token event comes this way
                    st.call.on_message(data[5:])
                except Exception:
                    log.exception("gRPC call failed on stream %d", st.id)
                    self._fail(st, INTERNAL, "internal error")
                    return
                if st.call is None or st.closed or not ev.end_stream:
                    return
                data = b""
        if data:
            st.parts = pieces.held(st.parts, data)  # small frames: folded, not an object each
            st.buffered += len(data)
        if ev.end_stream:
            st.half_closed = True
        self._deliver(st)

    def _deliver(self, st: Stream) -> None:
        """Hand the call its complete messages, then its half-close, while its output keeps
        up; a call's exception ends its own stream, never the connection.

        The buffered pieces are joined at most once per call and walked with an offset, so
        a buffer holding many small messages costs linear time; a large partial message
        is not joined until it is complete (its header is peeked)."""
        buf, pos = b"", 0
        while st.call is not None and st.pending_size <= OUT_HIGH and st.buffered >= 5:
            if buf:
                head = buf[pos:pos + 5]
            else:
                first = st.parts[0]
                head = first[:5] if len(first) >= 5 else b"".join(st.parts)[:5]
            if head[0] != 0:
                self._fail(st, UNIMPLEMENTED, "compressed messages are not supported")
                return
            n = int.from_bytes(head[1:5], "big")
            if n > self.max_message:
                self._fail(st, RESOURCE_EXHAUSTED,
                           f"message of {n} bytes exceeds the {self.max_message}-byte limit")
                return
            if st.buffered < 5 + n:
                break
            if not buf:
                buf = b"".join(st.parts)  # one bytes part is itself; a folded buffer, copied
                st.parts = []
            msg = buf[pos + 5:pos + 5 + n]
            st.idle_ticks = -1
            pos += 5 + n
            st.buffered -= 5 + n
            self.http2.consumed(5 + n)
            if not self._call(st, st.call.on_message, msg):
                if st.buffered and not st.parts:  # finished with input left: keep it counted
                    st.parts = [buf[pos:]]
                return
        if buf and st.buffered:
            st.parts = [buf[pos:]]
        if st.call is not None and st.half_closed and not st.buffered \
                and st.pending_size <= OUT_HIGH:
            st.half_closed = False
            st.idle_ticks = -1
            self._call(st, st.call.on_half_close)

    def _call(self, st: Stream, method: Callable[..., None], *args: bytes) -> bool:
        try:
            method(*args)
        except Exception:
            log.exception("gRPC call failed on stream %d", st.id)
            self._fail(st, INTERNAL, "internal error")
            return False
        return st.call is not None and not st.closed

    def _fail(self, st: Stream, status: int, message: str) -> None:
        call, st.call = st.call, None
        self._release(st)
        if call is not None:
            with contextlib.suppress(Exception):
                call.on_cancel()
        st.finish(status, message)

    def _release(self, st: Stream) -> None:
        """Undelivered input goes back to the connection window."""
        if st.buffered:
            self.http2.consumed(st.buffered)
            st.parts = []
            st.buffered = 0

    def drop(self, st: Stream) -> None:
        """The stream is over here. Its call is let go: the call holds its stream, and a
        cycle outlives its last use until the cyclic collector finds it (a request's ~40
        objects, 16-20 us a request of collections in process)."""
        if self.streams.pop(st.id, None) is not None and self.budget is not None:
            self.budget.open -= 1
        self._release(st)
        st.call = None

    def _reset(self, stream_id: int) -> bool:
        """The peer reset a stream: its call is cancelled. HTTP/2 "rapid reset"
        (CVE-2023-44487) is streams opened and reset at once: none counts against
        ``serving.max_streams``, each costs a call's setup. Envoy writes a call's first
        message as it opens the stream and resets streams only after, so past
        ``PREMATURE_RESETS`` streams reset before their first message (or half-close),
        at least half of those the peer opened, the connection ends with GOAWAY
        ENHANCE_YOUR_CALM; True if it did."""
        st = self.streams.get(stream_id)
        if st is not None and st.idle_ticks >= 0:
            self.premature += 1
            if self.premature >= PREMATURE_RESETS and 2 * self.premature >= self.opened:
                self.http2.close(http2.ENHANCE_YOUR_CALM,
                                 f"{self.premature} streams reset before their first message")
                self._write()
                log.warning("closing HTTP/2 connection: %d of %d streams reset before "
                            "their first message", self.premature, self.opened)
                self._linger()
                return True
        self._cancel(stream_id)
        return False

    def _cancel_all(self) -> None:
        for stream_id in list(self.streams):
            self._cancel(stream_id)

    def _cancel(self, stream_id: int) -> None:
        st = self.streams.get(stream_id)
        if st is None:
            return
        call = st.call
        self.drop(st)
        st.pending.clear()
        st.pending_size = 0
        if call is not None:
            st.closed = True
            call.on_cancel()

    # -- sending -----------------------------------------------------------------
    def flush(self, st: Stream) -> None:
        """Send what flow control allows; trailers follow the last byte; input held back
        for this stream's sake resumes once its output is low again."""
        pending = st.pending
        while pending:
            piece = pending[0]
            sent = self.http2.send_data(st.id, piece)
            st.pending_size -= sent
            if sent < len(piece):
                pending[0] = piece[sent:]  # the HTTP/2 connection wakes the stream for it
                return
            pending.popleft()
        if st.closed:
            self.http2.send_headers(st.id, st.trailers, end_stream=True)
            self.drop(st)
        elif st.buffered or st.half_closed:
            self._deliver(st)

    def _unblock(self, stream_id: int) -> None:
        """A stream's window grew (``stream_id``), or the connection's (0): the streams
        that waited for it send, only while it lasts."""
        if stream_id:
            st = self.streams.get(stream_id)
            if st is not None:
                self.flush(st)
            return
        woken = self.http2.woken
        while (sid := woken()) is not None:
            st = self.streams.get(sid)
            if st is not None:
                self.flush(st)

    def _write(self) -> None:
        data = self.http2.data_to_send()
        if (data and self.transport is not None and not self.transport.is_closing()
                and self.linger is None):  # lingering: our FIN is sent, nothing follows it
            self.transport.write(data)

    def write_soon(self) -> None:
        """For sends outside data_received (queue dispatch, expiry, health Watch): one
        write per loop iteration however many streams sent, instead of one each."""
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        self._write()
