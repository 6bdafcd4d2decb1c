"""A single-threaded gRPC server on asyncio, for the ext_proc hot path.

Why not grpcio here: measured with this project's benchmark (README, "Performance"),
grpc.aio's floor is ~55 µs of CPU per ext_proc message round trip even with an echo
servicer, because every message crosses three threads (the EventEngine I/O thread,
the completion-queue poller, the asyncio loop), and a paced token stream sends one
message per token. Here HTTP/2 is the sans-I/O ``http2.ServerConnection``, messages
stay xds-protos (upb) protobufs, and everything runs on the event loop that already
holds the router state: no thread handoffs, one socket write per read.

Scope is what Envoy's gRPC client uses: unary and streaming calls over h2c with prior
knowledge, identity encoding, status in trailers. Message size is bounded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from . import http2

log = logging.getLogger("narwhal.grpc")

# gRPC status codes used here.
OK = 0
INVALID_ARGUMENT = 3
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13

RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]


class Call(Protocol):
    """One RPC on a connection; the server feeds it decoded messages."""

    def on_message(self, data: bytes) -> None: ...

    def on_half_close(self) -> None: ...

    def on_cancel(self) -> None: ...


class Stream:
    """Per-stream framing state plus the send side handed to the call."""

    __slots__ = ("conn", "id", "buf", "call", "headers_sent", "closed", "pending", "trailers")

    def __init__(self, conn: GrpcConnection, stream_id: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.buf = b""
        self.call: Call | None = None
        self.headers_sent = False
        self.closed = False
        self.pending = b""
        self.trailers: list[tuple[bytes, bytes]] = []

    def send(self, message: bytes) -> None:
        if self.closed:
            return
        if not self.headers_sent:
            self.conn.http2.send_headers(self.id, RESPONSE_HEADERS)
            self.headers_sent = True
        frame = b"\x00" + len(message).to_bytes(4, "big") + message
        if self.pending:
            self.pending += frame
        else:
            sent = self.conn.http2.send_data(self.id, frame)
            if sent == len(frame):
                return
            self.pending = frame[sent:]
        self.conn.flush(self)

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
            self.conn.streams.pop(self.id, None)
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
        self.http2 = http2.ServerConnection()
        self.streams: dict[int, Stream] = {}
        self.blocked: set[int] = set()
        self.flush_scheduled = False

    # -- asyncio.Protocol --------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.http2.initiate()
        self._write()

    def data_received(self, data: bytes) -> None:
        for ev in self.http2.receive(data):
            cls = ev.__class__
            if cls is http2.DataReceived:
                self._data(ev)
            elif cls is http2.RequestReceived:
                self._request(ev)
            elif cls is http2.StreamReset:
                self._cancel(ev.stream_id)
            elif cls is http2.WindowUpdated:
                self._unblock(ev.stream_id)
            elif cls is http2.ConnectionTerminated:
                if ev.code:
                    log.warning("closing HTTP/2 connection: %s", ev.message)
                self._write()
                self.transport.close()
                return
        self._write()

    def connection_lost(self, exc: Exception | None) -> None:
        for stream_id in list(self.streams):
            self._cancel(stream_id)
        if self.on_lost is not None:
            self.on_lost(self)

    # -- streams -----------------------------------------------------------------
    def _request(self, ev: http2.RequestReceived) -> None:
        headers = dict(ev.headers)
        st = Stream(self, ev.stream_id)
        self.streams[ev.stream_id] = st
        factory = self.routes.get(headers.get(b":path", b""))
        if factory is None:
            st.finish(UNIMPLEMENTED, "unknown method")
        elif headers.get(b"grpc-encoding", b"identity") != b"identity":
            st.finish(UNIMPLEMENTED, "only identity encoding is supported")
        else:
            st.call = factory(st)
            if ev.end_stream:
                st.call.on_half_close()

    def _data(self, ev: http2.DataReceived) -> None:
        st = self.streams.get(ev.stream_id)
        if st is None or st.call is None:
            return
        buf = st.buf + ev.data if st.buf else ev.data
        pos, end = 0, len(buf)
        while end - pos >= 5:
            if buf[pos] != 0:
                st.buf = b""
                self._fail(st, UNIMPLEMENTED, "compressed messages are not supported")
                return
            n = int.from_bytes(buf[pos + 1:pos + 5], "big")
            if n > self.max_message:
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
        if ev.end_stream and st.call is not None:
            st.call.on_half_close()

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

    # -- sending -----------------------------------------------------------------
    def flush(self, st: Stream) -> None:
        """Send what flow control allows; trailers follow the last byte."""
        if st.pending:
            sent = self.http2.send_data(st.id, st.pending)
            st.pending = st.pending[sent:]
            if st.pending:
                self.blocked.add(st.id)
                return
        self.blocked.discard(st.id)
        if st.closed:
            self.http2.send_headers(st.id, st.trailers, end_stream=True)
            self.streams.pop(st.id, None)

    def _unblock(self, stream_id: int) -> None:
        for sid in list(self.blocked) if stream_id == 0 else [stream_id]:
            st = self.streams.get(sid)
            if st is not None and sid in self.blocked:
                self.flush(st)

    def _write(self) -> None:
        data = self.http2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
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
