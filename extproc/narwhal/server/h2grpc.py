"""A single-threaded gRPC server on asyncio + h2, for the ext_proc hot path.

Why not grpcio here: measured on this project's benchmark (README, "Performance"),
grpc.aio's floor is ~55 µs of CPU per ext_proc message round trip even with an echo
servicer, because every message crosses three threads (the EventEngine I/O thread,
the completion-queue poller, the asyncio loop). A paced token stream sends one
message per token, so that floor alone exceeds the budget. Here the HTTP/2 state
machine is h2 (python-hyper's, the field's HTTP/2 library), messages stay xds-protos
(upb) protobufs, and everything runs on the event loop that already holds the
router state: no thread handoffs, and one socket write per read.

Scope is what Envoy's gRPC client uses: unary and streaming calls over h2c with
prior knowledge, identity encoding, trailers-only status. Everything the peer
controls is bounded (message size, header list size, concurrent streams).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

log = logging.getLogger("narwhal.h2grpc")

# gRPC status codes used here.
OK = 0
INVALID_ARGUMENT = 3
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13

WINDOW = 16 * 1024 * 1024
MAX_CONCURRENT_STREAMS = 16384
MAX_HEADER_LIST = 64 * 1024
RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]


class Call(Protocol):
    """One RPC on a connection; the server feeds it decoded messages."""

    def on_message(self, data: bytes) -> None: ...

    def on_half_close(self) -> None: ...

    def on_cancel(self) -> None: ...


class Stream:
    """Per-stream framing state plus the send side handed to the call."""

    __slots__ = ("conn", "id", "buf", "call", "headers_sent", "closed", "pending", "max_message",
                 "trailers")

    def __init__(self, conn: GrpcConnection, stream_id: int, max_message: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.buf = b""
        self.call: Call | None = None
        self.headers_sent = False
        self.closed = False
        self.pending = b""
        self.max_message = max_message
        self.trailers: list[tuple[bytes, bytes]] = []

    def send(self, message: bytes) -> None:
        if self.closed:
            return
        if not self.headers_sent:
            self.conn.h2.send_headers(self.id, RESPONSE_HEADERS)
            self.headers_sent = True
        n = len(message)
        self.pending += b"\x00" + n.to_bytes(4, "big") + message
        self.conn.flush(self)

    def finish(self, status: int = OK, message: str = "") -> None:
        """Send trailers (after any data still waiting for flow-control window)."""
        if self.closed:
            return
        self.closed = True
        trailers = [(b"grpc-status", str(status).encode())]
        if message:
            trailers.append((b"grpc-message", message.encode("ascii", "replace")))
        self.trailers = trailers
        if not self.headers_sent:
            self.conn.h2.send_headers(self.id, RESPONSE_HEADERS[:2] + trailers, end_stream=True)
            self.conn.forget(self.id)
            return
        self.conn.flush(self)


class GrpcConnection(asyncio.Protocol):
    """One HTTP/2 connection from Envoy; routes each stream to a call factory by path."""

    def __init__(self, routes: dict[bytes, Callable[[Stream], Call]],
                 max_message: int = 64 * 1024 * 1024,
                 on_lost: Callable[[GrpcConnection], None] | None = None) -> None:
        self.routes = routes
        self.max_message = max_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None, validate_outbound_headers=False,
            normalize_outbound_headers=False))
        self.streams: dict[int, Stream] = {}
        self.blocked: set[int] = set()

    # -- asyncio.Protocol --------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        s = h2.settings.SettingCodes
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            s.INITIAL_WINDOW_SIZE: WINDOW, s.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            s.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST, s.ENABLE_PUSH: 0})
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(WINDOW)
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.warning("closing HTTP/2 connection on protocol error: %s", exc)
            self._write()
            self.transport.close()
            return
        for ev in events:
            cls = ev.__class__
            if cls is h2.events.DataReceived:
                self._data(ev)
            elif cls is h2.events.RequestReceived:
                self._request(ev)
            elif cls is h2.events.StreamEnded:
                st = self.streams.get(ev.stream_id)
                if st is not None and st.call is not None:
                    st.call.on_half_close()
            elif cls is h2.events.StreamReset:
                self._cancel(ev.stream_id)
            elif cls is h2.events.WindowUpdated:
                self._unblock(ev.stream_id)
            elif cls is h2.events.ConnectionTerminated:
                self.transport.close()
        self._write()

    def connection_lost(self, exc: Exception | None) -> None:
        for stream_id in list(self.streams):
            self._cancel(stream_id)
        if self.on_lost is not None:
            self.on_lost(self)

    # -- streams -----------------------------------------------------------------
    def _request(self, ev: h2.events.RequestReceived) -> None:
        headers = dict(ev.headers)
        st = Stream(self, ev.stream_id, self.max_message)
        self.streams[ev.stream_id] = st
        factory = self.routes.get(headers.get(b":path", b""))
        if factory is None:
            st.finish(UNIMPLEMENTED, "unknown method")
            return
        if headers.get(b"grpc-encoding", b"identity") != b"identity":
            st.finish(UNIMPLEMENTED, "only identity encoding is supported")
            return
        st.call = factory(st)

    def _data(self, ev: h2.events.DataReceived) -> None:
        sid = ev.stream_id
        if ev.flow_controlled_length:
            self.h2.acknowledge_received_data(ev.flow_controlled_length, sid)
        st = self.streams.get(sid)
        if st is None or st.call is None:
            return
        buf = st.buf + ev.data if st.buf else ev.data
        pos, end = 0, len(buf)
        while end - pos >= 5:
            n = int.from_bytes(buf[pos + 1:pos + 5], "big")
            if buf[pos] != 0:
                st.buf = b""
                self._fail(st, UNIMPLEMENTED, "compressed messages are not supported")
                return
            if n > st.max_message:
                st.buf = b""
                self._fail(st, RESOURCE_EXHAUSTED, "message exceeds the size limit")
                return
            if end - pos - 5 < n:
                break
            msg = buf[pos + 5:pos + 5 + n]
            pos += 5 + n
            st.call.on_message(msg)
            if st.closed:
                return
        st.buf = buf[pos:] if pos < end else b""

    def _fail(self, st: Stream, status: int, message: str) -> None:
        call, st.call = st.call, None
        if call is not None:
            call.on_cancel()
        st.finish(status, message)

    def _cancel(self, stream_id: int) -> None:
        st = self.streams.pop(stream_id, None)
        self.blocked.discard(stream_id)
        if st is not None and st.call is not None:
            call, st.call = st.call, None
            st.closed = True
            call.on_cancel()

    def forget(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        self.blocked.discard(stream_id)

    # -- sending -----------------------------------------------------------------
    def flush(self, st: Stream) -> None:
        """Send as much of the stream's pending data as flow control allows."""
        conn = self.h2
        try:
            while st.pending:
                window = conn.local_flow_control_window(st.id)
                if window <= 0:
                    self.blocked.add(st.id)
                    return
                size = min(window, conn.max_outbound_frame_size, len(st.pending))
                conn.send_data(st.id, st.pending[:size])
                st.pending = st.pending[size:]
            self.blocked.discard(st.id)
            if st.closed:
                conn.send_headers(st.id, st.trailers, end_stream=True)
                self.forget(st.id)
        except h2.exceptions.StreamClosedError:
            self._cancel(st.id)

    def _unblock(self, stream_id: int) -> None:
        ids = list(self.blocked) if stream_id == 0 else [stream_id]
        for sid in ids:
            st = self.streams.get(sid)
            if st is not None:
                self.flush(st)

    def _write(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def write_soon(self) -> None:
        """For calls that send outside data_received (health Watch updates)."""
        self._write()
