"""Incremental server-sent-events parsing for engine response streams.

Engines' chunks split anywhere: inside a line, between ``\\r`` and ``\\n``, inside a
UTF-8 sequence. The parser keeps the partial line and yields only complete events'
``data`` payloads; comments and other fields are dropped.

Engine output is not trusted, so the work is linear and the memory bounded: an event's
``data`` lines and a partial line are kept as lists of pieces, joined once, and one
bound applies to the raw bytes of the current event received so far (its lines and the
partial line), so the same stream fails the same way however it is chunked. Past
``pieces.PIECES`` a list is folded into one growing buffer: a bytes object per piece is
~40 bytes beside its own (measured: a 1 MiB event of two-byte lines held 5.0 MiB, a
line trickled two bytes a chunk 21.6x its bytes), and ``held`` counts the raw bytes.
The work per line is bounded too (``MIN_LINE_BYTES``): that bound counts the lines the
line loop parses, so how much credit well-formed events leave depends on how they were
chunked; a stream fails it only when most of its lines are nearly empty.
"""

from __future__ import annotations

from . import pieces

# Blank lines and comments between events are legal SSE, and each costs the line loop
# ~0.3-0.5 us (measured: four MiB of blank lines after a token cost the router 1.7 s
# of CPU through Envoy). Lines past FREE_LINES must average MIN_LINE_BYTES (a token
# event's line is 100-300 bytes, its blank line 1); whole one-line events on the fast
# paths below are not counted at all, so the free lines are what keep-alive comments
# between them may use: 65,536 (~20-30 ms of the loop, what the answer's free pieces
# cost), a keep-alive comment a second for 11 hours.
FREE_LINES = 65_536
MIN_LINE_BYTES = 32


class SSEError(ValueError):
    """The engine's stream is not valid SSE within Narwhal's bounds."""


class SSEParser:
    __slots__ = ("_pending", "_pending_size", "_data", "_size", "_max", "_credit",
                 "_free_lines")

    def __init__(self, max_event_bytes: int = 1_048_576, free_lines: int = FREE_LINES) -> None:
        self._pending: list[bytes] = []  # pieces of the current, unterminated line
        self._pending_size = 0
        self._data: list[bytes] | None = None  # the current event's data lines
        self._size = 0  # raw bytes of the current event's complete lines
        self._max = max_event_bytes
        self._free_lines = free_lines
        self._credit = free_lines * MIN_LINE_BYTES  # lines' bytes in, MIN_LINE_BYTES out each

    def held(self) -> int:
        """Raw bytes of the event still being received (its complete lines and the partial
        line): what the parser holds until the event ends."""
        return self._size + self._pending_size

    def _check(self) -> None:
        pending = self._pending_size
        if pending == 1 and self._pending[0] == b"\r":
            pending = 0  # a blank line's CR, which counts no more than its LF will
        if self._size + pending > self._max:
            raise SSEError(f"engine event exceeds {self._max} bytes")

    def feed(self, chunk: bytes) -> list[bytes]:
        nl = chunk.find(b"\n")
        # The common chunk is exactly one event, ``data: {...}\n\n``, with nothing held
        # from earlier chunks: answer it without the line loop (it runs per token).
        end = len(chunk) - 2
        if (nl == end and self._data is None and not self._pending and nl > 6 and not self._size
                and chunk.startswith(b"data: ") and chunk[end + 1] == 0x0A
                and chunk[end - 1] != 0x0D and end + 2 <= self._max):
            return [chunk[6:end]]
        if nl > 6 and self._data is None and not self._pending and not self._size \
                and chunk.endswith(b"\n\n") and chunk[nl + 1:nl + 2] == b"\n":
            fast = self._whole_events(chunk)
            if fast is not None:
                return fast
        if nl < 0:
            if chunk:
                self._pending = pieces.held(self._pending, chunk)
                self._pending_size += len(chunk)
                self._check()
            return []
        if self._pending:
            self._pending.append(chunk)
            buf = b"".join(self._pending)
            nl += self._pending_size
            self._pending = []
            self._pending_size = 0
        else:
            buf = chunk
        # Lines cost the loop below ~0.5 us each whatever their length: past the free
        # lines, they must bring MIN_LINE_BYTES on average (counted in C before looping).
        credit = self._credit + buf.rfind(b"\n") + 1 - MIN_LINE_BYTES * buf.count(b"\n")
        self._credit = credit
        if credit < 0:
            raise SSEError(f"engine sent lines of under {MIN_LINE_BYTES} bytes on average "
                           f"(past the first {self._free_lines} lines)")
        events: list[bytes] = []
        start = 0
        find = buf.find
        limit = self._max
        size = self._size
        data = self._data
        while nl >= 0:
            line = buf[start:nl]
            size += nl + 1 - start
            start = nl + 1
            nl = find(b"\n", start)
            if line[-1:] == b"\r":
                line = line[:-1]
            if not line:
                if data is not None:
                    events.append(bytes(data[0]) if len(data) == 1 else b"\n".join(data))
                    data = None
                size = 0
                continue
            if size > limit:
                self._data = data
                self._size = size
                self._check()
            if line[0] == 0x3A:  # ':' comment / keep-alive
                continue
            name, sep, value = line.partition(b":")
            if name != b"data":
                continue  # event:, id:, retry: carry nothing Narwhal uses
            if value[:1] == b" ":
                value = value[1:]
            if not sep:
                value = b""
            data = [value] if data is None else pieces.held(data, value, b"\n")
        self._data = data
        self._size = size
        if start < len(buf):
            rest = buf[start:]
            self._pending = [rest]
            self._pending_size = len(rest)
            self._check()
        return events

    def _whole_events(self, chunk: bytes) -> list[bytes] | None:
        """A chunk of several whole one-line ``data:`` events and nothing else (an engine
        that writes two tokens at once, the usage event with ``[DONE]``): the payloads,
        as the line loop would find them; None for anything else, which the loop parses."""
        parts = chunk.split(b"\n\n")
        parts.pop()  # the chunk ends with a blank line: the last piece is empty
        if chunk.count(b"\n") != 2 * len(parts):  # a piece holds a newline: not one line
            return None
        limit = self._max - 2
        out = []
        for piece in parts:
            # a trailing ``\r`` the loop would strip; an event near the bound: the loop decides
            if piece[:6] != b"data: " or piece[-1] == 0x0D or len(piece) > limit:
                return None
            out.append(piece[6:])
        return out

    def close(self) -> list[bytes]:
        """End of stream: a final event without its blank line still counts."""
        events = self.feed(b"\n") if self._pending else []
        if self._data is not None:
            events.append(b"\n".join(self._data))
            self._data = None
            self._size = 0
        return events
