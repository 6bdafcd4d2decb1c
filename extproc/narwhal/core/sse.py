"""Incremental server-sent-events parsing for engine response streams.

Engines' chunks split anywhere: inside a line, between ``\\r`` and ``\\n``, inside a
UTF-8 sequence. The parser keeps the partial line and yields only complete events'
``data`` payloads; comments and other fields are dropped. The pending buffer is
bounded, because engine output is not trusted.
"""

from __future__ import annotations


class SSEError(ValueError):
    """The engine's stream is not valid SSE within Narwhal's bounds."""


class SSEParser:
    __slots__ = ("_buf", "_data", "_max")

    def __init__(self, max_event_bytes: int = 1_048_576) -> None:
        self._buf = b""
        self._data: bytes | None = None
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        events: list[bytes] = []
        start = 0
        find = buf.find
        while True:
            nl = find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line[-1:] == b"\r":
                line = line[:-1]
            if not line:
                if self._data is not None:
                    events.append(self._data)
                    self._data = None
                continue
            if line[0] == 0x3A:  # ':' comment / keep-alive
                continue
            name, sep, value = line.partition(b":")
            if name != b"data":
                continue  # event:, id:, retry: carry nothing Narwhal uses
            if value[:1] == b" ":
                value = value[1:]
            if not sep:
                value = b""
            self._data = value if self._data is None else self._data + b"\n" + value
            if len(self._data) > self._max:
                raise SSEError(f"engine event exceeds {self._max} bytes")
        self._buf = buf[start:] if start < len(buf) else b""
        if len(self._buf) > self._max:
            raise SSEError(f"engine event exceeds {self._max} bytes")
        return events

    def close(self) -> list[bytes]:
        """End of stream: a final event without its blank line still counts."""
        events = self.feed(b"\n") if self._buf else []
        if self._data is not None:
            events.append(self._data)
            self._data = None
        return events
