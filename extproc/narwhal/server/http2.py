"""A sans-I/O HTTP/2 server connection: the subset a gRPC server needs, and fast.

Why not h2 (python-hyper) on the hot path: it was this transport's first version, and
measured here it spent ~15 µs of CPU per ext_proc message round trip in framing
alone (frame objects, flag sets, eager ``repr`` for trace logging), more than half of
the per-token budget. The frame layer of RFC 9113 is small; header compression stays
with the field's library, ``hpack``. h2 remains the independent peer that the unit
tests drive this implementation with.

Bounded against a misbehaving peer, in linear time: frame size (our
SETTINGS_MAX_FRAME_SIZE), header block size and CONTINUATION count (a running total, not
a re-sum per frame), concurrent streams, and inbound flow control. The connection
window is returned to the peer only for data the application has *consumed*
(:meth:`ServerConnection.consumed`), not merely received, so what a peer can make this
process hold (partial messages on many streams, input for a stream whose output is
not being read) is bounded by the connection window.

No frame costs a pass over the open streams. A stream's send window is kept relative to
the peer's SETTINGS_INITIAL_WINDOW_SIZE, which changes every open stream's window: a
change is one assignment (kept per stream, one 16 KB SETTINGS frame of 2,730 such
entries cost 2 s of CPU over 16,384 streams). A stream that could not send all it had
waits for the connection's window or for its own, and only a window it waits for wakes
it: a connection WINDOW_UPDATE wakes streams in order while its window lasts
(:meth:`ServerConnection.woken`), a stream's own update or the setting's growth wakes
that stream (the latter through a heap by the initial window each needs). One deviation
from RFC 9113: a change of the setting that takes an open stream's window past 2**31-1
is not detected (detecting it is a pass over the streams); a window is only ever used
up to the connection's, which is checked.
"""

from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass

import hpack
from hpack.table import HeaderTable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0, 1, 2, 3, 6
REFUSED_STREAM, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 7, 9, 11
# A frame's 9-byte header in one call: length (24 bits) and type as one word, flags, the
# stream identifier with its reserved bit.
_FRAME_HEAD = struct.Struct(">IBI")
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
MAX_CONTINUATIONS = 256  # CONTINUATION frames in one header block


class ConnectionError_(Exception):  # noqa: N801 - not the builtin
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class RequestReceived:
    stream_id: int
    headers: list[tuple[bytes, bytes]]
    end_stream: bool


@dataclass(slots=True)
class DataReceived:
    stream_id: int
    data: bytes
    end_stream: bool


@dataclass(slots=True)
class StreamReset:
    stream_id: int


@dataclass(slots=True)
class WindowUpdated:
    """A stream that waited for its own window may send again; or, with stream id 0, the
    connection's window grew: the streams that waited for it are :meth:`~ServerConnection.
    woken` in turn."""

    stream_id: int


@dataclass(slots=True)
class ConnectionTerminated:
    code: int
    message: str


Event = RequestReceived | DataReceived | StreamReset | WindowUpdated | ConnectionTerminated


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME_HEAD.pack(len(payload) << 8 | kind, flags, stream_id) + payload


class _CountingTable(HeaderTable):
    """hpack's dynamic table, counting its changes: a header block decoded while the count
    stayed put read the table without changing it, so the same bytes decode to the same
    headers for as long as the count stays put."""

    changes = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.changes += 1
        super().add(name, value)

    @HeaderTable.maxsize.setter
    def maxsize(self, newmax: int) -> None:
        self.changes += 1
        HeaderTable.maxsize.fset(self, newmax)  # type: ignore[misc]


class _Remembered:
    """The last few header blocks whose coding left the dynamic table as it was, each
    valid while the table's change count is the one it was coded at."""

    SIZE = 16

    def __init__(self, table: _CountingTable) -> None:
        self.table = table
        self.items: dict[object, tuple[int, object]] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.items

    def get(self, key: object) -> object | None:
        hit = self.items.get(key)
        return hit[1] if hit is not None and hit[0] == self.table.changes else None

    def keep(self, key: object, changes: int, value: object) -> None:
        """Remember ``value`` if the table still has ``changes`` (the coding only read it)."""
        if self.table.changes != changes:
            return
        if len(self.items) >= self.SIZE:
            self.items.clear()
        self.items[key] = (changes, value)


class _Encoder:
    """``hpack.Encoder`` with the last blocks that changed nothing remembered: every
    ext_proc stream is answered with the same response headers and trailers, which after
    the first are references into the dynamic table, the same bytes each time."""

    def __init__(self) -> None:
        self.encoder = hpack.Encoder()
        self.encoder.header_table = self.table = _CountingTable()
        self.blocks = _Remembered(self.table)

    def resize(self, size: int) -> None:
        """The peer's SETTINGS_HEADER_TABLE_SIZE (the next block announces it: the resize
        counts as a change, so no block remembered before it is used after)."""
        self.encoder.header_table_size = size

    def encode(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        key = tuple(headers)
        block = self.blocks.get(key)
        if block is None:
            changes = self.table.changes
            block = self.encoder.encode(headers)
            self.blocks.keep(key, changes, block)
        return block  # type: ignore[return-value]


class _Decoder:
    """``hpack.Decoder`` with the last read-only header blocks remembered. Envoy opens an
    ext_proc stream per request with the same headers, which after the first are all
    references into the dynamic table: the same bytes each time. Decoding them in pure
    Python was a tenth of a request's CPU here; a lookup is not."""

    MAX_BLOCK = 256  # bytes of a block worth remembering (Envoy's are ~10)

    def __init__(self, max_header_list: int) -> None:
        self.decoder = hpack.Decoder()
        self.decoder.header_table = self.table = _CountingTable()
        self.decoder.max_header_list_size = max_header_list
        self.blocks = _Remembered(self.table)

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        headers = self.blocks.get(block)
        if headers is None:
            changes = self.table.changes
            headers = [(bytes(k), bytes(v)) for k, v in self.decoder.decode(block, raw=True)]
            if len(block) <= self.MAX_BLOCK:  # a peer's large blocks are not worth holding
                self.blocks.keep(block, changes, headers)
        return headers  # type: ignore[return-value]


class ServerConnection:
    """Feed it bytes with ``receive``; send with ``send_*``; write ``data_to_send()``."""

    def __init__(self, window: int = 8 * 1024 * 1024, max_streams: int = 16384,
                 max_header_list: int = 65536) -> None:
        self.window = window
        self.half_window = window // 2  # received bytes returned to the peer at this many
        self.max_streams = max_streams
        self.max_header_list = max_header_list
        self.decoder = _Decoder(max_header_list)
        self.encoder = _Encoder()
        self.out: list[bytes] = []
        self.buf = b""
        self.preface = False
        self.closed = False
        self.last_stream = 0
        # Outbound flow control (the peer's windows), inbound accounting (ours). An open
        # stream's window is ``peer_initial_window + send_credit[id]``.
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME
        self.conn_send_window = DEFAULT_WINDOW
        self.send_credit: dict[int, int] = {}
        # Streams that stopped short: waiting for the connection's window (in order), or
        # for their own (each with the initial window above which it has some; the heap
        # holds the same, plus entries gone stale, dropped as met or when it is rebuilt).
        self.wanting_connection: dict[int, None] = {}
        self.wanting_own: dict[int, int] = {}
        self.wake_heap: list[tuple[int, int]] = []
        self.recv_unacked: dict[int, int] = {}
        self.conn_recv_window = window
        self.conn_recv_unacked = 0
        self.header_block: list[bytes] | None = None
        self.header_size = 0
        self.header_stream = 0
        self.header_end_stream = False

    # -- output ------------------------------------------------------------------
    def initiate(self) -> None:
        settings = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in (
            (0x2, 0), (0x3, self.max_streams), (0x4, self.window), (0x6, self.max_header_list)))
        self.out.append(_frame(SETTINGS, 0, 0, settings))
        if self.window > DEFAULT_WINDOW:
            self.out.append(_frame(WINDOW_UPDATE, 0, 0,
                                   (self.window - DEFAULT_WINDOW).to_bytes(4, "big")))

    def data_to_send(self) -> bytes:
        if not self.out:
            return b""
        data = b"".join(self.out)
        self.out.clear()
        return data

    def send_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]],
                     end_stream: bool = False) -> None:
        block = self.encoder.encode(headers)
        flags = END_STREAM if end_stream else 0
        size = self.peer_max_frame
        if len(block) <= size:
            self.out.append(_frame(HEADERS, flags | END_HEADERS, stream_id, block))
        else:
            chunks = [block[i:i + size] for i in range(0, len(block), size)]
            self.out.append(_frame(HEADERS, flags, stream_id, chunks[0]))
            for i, chunk in enumerate(chunks[1:], 2):
                self.out.append(_frame(CONTINUATION, END_HEADERS if i == len(chunks) else 0,
                                       stream_id, chunk))
        if end_stream:
            self._forget(stream_id)

    def send_window(self, stream_id: int) -> int:
        credit = self.send_credit.get(stream_id)
        if credit is None:
            return 0
        return min(self.conn_send_window, self.peer_initial_window + credit)

    def send_data(self, stream_id: int, data: bytes) -> int:
        """Send as much of ``data`` as windows allow; return how many bytes went. A stream
        that sent less than all waits for the window it lacks (``WindowUpdated``)."""
        credit = self.send_credit.get(stream_id)
        if credit is None:
            return 0
        n = len(data)
        window = self.peer_initial_window + credit  # ``send_window``, inline: every event
        if self.conn_send_window < window:
            window = self.conn_send_window
        if window < n:
            n = window if window > 0 else 0
            self._stopped(stream_id, credit - n)
            if not n:
                return 0
            data = data[:n]
        size = self.peer_max_frame
        out = self.out
        if n <= size:  # ``_frame(DATA, 0, ...)`` written out: it runs for every token event
            out.append(_FRAME_HEAD.pack(n << 8 | DATA, 0, stream_id) + data)
        else:
            for i in range(0, n, size):
                out.append(_frame(DATA, 0, stream_id, data[i:i + size]))
        self.conn_send_window -= n
        self.send_credit[stream_id] = credit - n
        return n

    def _stopped(self, stream_id: int, credit: int) -> None:
        """``stream_id``, an open stream, sends less than it has and is left with
        ``credit``: it waits for the window it lacks."""
        if self.peer_initial_window + credit > 0:  # it has window: the connection lacks it
            self.wanting_connection[stream_id] = None
        else:
            self._wait_own(stream_id, credit)

    def _wait_own(self, stream_id: int, credit: int) -> None:
        """``stream_id`` waits for its own window, which the initial window's growth past
        ``-credit`` gives it; its heap entry before this one, if any, is stale."""
        self.wanting_own[stream_id] = -credit
        heap = self.wake_heap
        if len(heap) > 2 * len(self.wanting_own) + 64:  # mostly stale: rebuilt, linear
            heap[:] = [(need, sid) for sid, need in self.wanting_own.items()]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, (-credit, stream_id))

    def woken(self) -> int | None:
        """The next stream that waited for the connection's window, while there is some;
        one that still cannot send all it has waits again (behind the others)."""
        if self.conn_send_window <= 0 or not self.wanting_connection:
            return None
        stream_id = next(iter(self.wanting_connection))
        del self.wanting_connection[stream_id]
        return stream_id

    def reset(self, stream_id: int, code: int = INTERNAL_ERROR) -> None:
        self.out.append(_frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big")))
        self._forget(stream_id)

    def close(self, code: int = NO_ERROR, message: str = "") -> None:
        if not self.closed:
            self.out.append(_frame(GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big")
                                   + code.to_bytes(4, "big") + message.encode()[:256]))
            self.closed = True

    def _forget(self, stream_id: int) -> None:
        self.send_credit.pop(stream_id, None)
        self.recv_unacked.pop(stream_id, None)
        self.wanting_connection.pop(stream_id, None)
        self.wanting_own.pop(stream_id, None)  # its heap entry, if any, is stale now

    # -- input -------------------------------------------------------------------
    def receive(self, data: bytes) -> list[Event]:
        if self.closed:
            return []
        try:
            return self._receive(data)
        except ConnectionError_ as exc:
            self.close(exc.code, str(exc))
            return [ConnectionTerminated(exc.code, str(exc))]
        except hpack.HPACKError as exc:
            self.close(COMPRESSION_ERROR, "bad header block")
            return [ConnectionTerminated(COMPRESSION_ERROR, str(exc))]

    def _receive(self, data: bytes) -> list[Event]:
        buf = self.buf + data if self.buf else data
        pos = 0
        if not self.preface:
            if len(buf) < 24:
                if not PREFACE.startswith(buf):
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.buf = buf
                return []
            if buf[:24] != PREFACE:
                raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self.preface = True
            pos = 24
        events: list[Event] = []
        end = len(buf)
        head = _FRAME_HEAD.unpack_from
        while end - pos >= 9:
            length_kind, flags, sid = head(buf, pos)
            length = length_kind >> 8
            if length > DEFAULT_FRAME:
                raise ConnectionError_(FRAME_SIZE_ERROR, "frame exceeds SETTINGS_MAX_FRAME_SIZE")
            if end - pos - 9 < length:
                break
            kind = length_kind & 0xFF
            sid &= 0x7FFFFFFF
            payload = buf[pos + 9:pos + 9 + length]
            pos += 9 + length
            if self.header_block is not None and kind != CONTINUATION:
                raise ConnectionError_(PROTOCOL_ERROR, "expected CONTINUATION")
            if kind == DATA:
                self._data(sid, flags, payload, events)
            elif kind == HEADERS:
                self._headers(sid, flags, payload, events)
            elif kind == CONTINUATION:
                self._continuation(sid, flags, payload, events)
            elif kind == WINDOW_UPDATE:
                self._window_update(sid, payload, events)
            elif kind == SETTINGS:
                self._settings(sid, flags, payload, events)
            elif kind == PING:
                if len(payload) != 8 or sid:
                    raise ConnectionError_(FRAME_SIZE_ERROR, "bad PING")
                if not flags & ACK:
                    self.out.append(_frame(PING, ACK, 0, payload))
            elif kind == RST_STREAM:
                if sid in self.send_credit:
                    self._forget(sid)
                    events.append(StreamReset(sid))
            elif kind == GOAWAY:
                code = int.from_bytes(payload[4:8], "big") if len(payload) >= 8 else 0
                self.closed = True
                events.append(ConnectionTerminated(code, "peer sent GOAWAY"))
                break
            elif kind == PUSH_PROMISE:
                raise ConnectionError_(PROTOCOL_ERROR, "clients cannot push")
            # PRIORITY and unknown frame types are ignored, as RFC 9113 requires.
        self.buf = buf[pos:] if pos < end else b""
        return events

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise ConnectionError_(PROTOCOL_ERROR, "bad padding")
            return payload[1:len(payload) - payload[0]]
        return payload

    def consumed(self, n: int) -> None:
        """The application is done with ``n`` bytes of received DATA: the peer may send
        that much more on the connection (one WINDOW_UPDATE per half window)."""
        self.conn_recv_unacked += n
        if self.conn_recv_unacked >= self.half_window:
            self.out.append(_frame(WINDOW_UPDATE, 0, 0, self.conn_recv_unacked.to_bytes(4, "big")))
            self.conn_recv_window += self.conn_recv_unacked
            self.conn_recv_unacked = 0

    def _data(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        if sid == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
        n = len(payload)
        self.conn_recv_window -= n
        if self.conn_recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "peer overran the connection window")
        unacked = self.recv_unacked.get(sid)
        if unacked is None:
            self.consumed(n)  # a stream we already finished or reset: counted, then dropped
            return
        # Stream windows are replenished on receipt; the connection window bounds memory.
        unacked += n
        if unacked >= self.half_window:
            self.out.append(_frame(WINDOW_UPDATE, 0, sid, unacked.to_bytes(4, "big")))
            unacked = 0
        self.recv_unacked[sid] = unacked
        data = self._unpad(flags, payload) if flags & PADDED else payload
        if len(data) < n:
            self.consumed(n - len(data))  # padding is nobody's to consume
        events.append(DataReceived(sid, data, bool(flags & END_STREAM)))

    def _headers(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        if sid == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        self.header_block = [payload]
        self.header_size = len(payload)
        self.header_stream = sid
        self.header_end_stream = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._header_block_done(events)

    def _continuation(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        if self.header_block is None or sid != self.header_stream:
            raise ConnectionError_(PROTOCOL_ERROR, "unexpected CONTINUATION")
        self.header_block.append(payload)
        self.header_size += len(payload)
        if self.header_size > self.max_header_list:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block too large")
        if len(self.header_block) > MAX_CONTINUATIONS:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "too many CONTINUATION frames")
        if flags & END_HEADERS:
            self._header_block_done(events)

    def _header_block_done(self, events: list[Event]) -> None:
        assert self.header_block is not None
        block = b"".join(self.header_block)
        sid, end_stream = self.header_stream, self.header_end_stream
        self.header_block = None
        headers = self.decoder.decode(block)  # keeps HPACK state in step
        if sid in self.send_credit:
            if end_stream:  # trailers from the client: only their END_STREAM matters
                events.append(DataReceived(sid, b"", True))
            return
        if sid <= self.last_stream or sid % 2 == 0:
            if sid % 2 == 0 or sid == self.last_stream:
                raise ConnectionError_(PROTOCOL_ERROR, "invalid stream id")
            return  # headers for a stream we already closed
        self.last_stream = sid
        if len(self.send_credit) >= self.max_streams:
            self.out.append(_frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
            return
        self.send_credit[sid] = 0
        self.recv_unacked[sid] = 0
        events.append(RequestReceived(sid, headers, end_stream))

    def _window_update(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not inc:  # RFC 9113 6.9: an error of the window it names
            if sid == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            if sid in self.send_credit:
                self.reset(sid, PROTOCOL_ERROR)
                events.append(StreamReset(sid))
            return
        if sid == 0:
            self.conn_send_window += inc
            if self.conn_send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "connection window overflow")
            if self.wanting_connection:
                events.append(WindowUpdated(0))
            return
        credit = self.send_credit.get(sid)
        if credit is None:
            return
        credit += inc
        self.send_credit[sid] = credit
        if self.peer_initial_window + credit > MAX_WINDOW:
            self.reset(sid, FLOW_CONTROL_ERROR)
            events.append(StreamReset(sid))
        elif sid in self.wanting_own:
            if self.peer_initial_window + credit > 0:
                del self.wanting_own[sid]  # its heap entry is stale now
                events.append(WindowUpdated(sid))
            else:  # still none: a smaller growth of the initial window will do
                self._wait_own(sid, credit)

    def _settings(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        if sid:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "bad SETTINGS")
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i:i + 2], "big")
            value = int.from_bytes(payload[i + 2:i + 6], "big")
            if key == 0x1:
                self.encoder.resize(value)
            elif key == 0x2 and value > 1:
                raise ConnectionError_(PROTOCOL_ERROR, "bad SETTINGS_ENABLE_PUSH")
            elif key == 0x4:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "initial window too large")
                self.peer_initial_window = value  # every open stream's window moves with it
            elif key == 0x5:
                if not DEFAULT_FRAME <= value <= 16777215:
                    raise ConnectionError_(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                self.peer_max_frame = value
        self.out.append(_frame(SETTINGS, ACK, 0))
        heap, initial = self.wake_heap, self.peer_initial_window
        while heap and heap[0][0] < initial:  # these streams have window again
            need, stream_id = heapq.heappop(heap)
            if self.wanting_own.get(stream_id) == need:
                del self.wanting_own[stream_id]
                events.append(WindowUpdated(stream_id))
