"""Engine output kept until a response ends, held as JSON text rather than parsed.

Parsed, JSON takes five to ten times its bytes (measured: 16 MiB of events' logprobs
held 80 MiB, of token IDs 118 MiB; 1 MiB of small request messages 9.8 MiB), and a
router holds up to a thousand responses at once. What passes through unchanged (token
IDs, logprobs, metadata, the parts of usage nobody reads) is kept as text, about its
bytes, and spliced into the response with ``orjson.Fragment`` when it is written.

orjson reads 1,024 levels of nesting and writes 254: text for a value nested between
them cannot be written, and ``text`` raises ``TypeError`` as orjson does, for the caller
to name as malformed output when it comes rather than at the response's end.
"""

from __future__ import annotations

from typing import Any

import orjson

from .pieces import PIECES


def text(value: Any) -> bytes:
    """``value`` as JSON text; ``TypeError`` past 254 levels of nesting."""
    return orjson.dumps(value)


def kept(value: Any) -> tuple[orjson.Fragment, int]:
    """JSON text to keep until the response is written, and its size. In a buffer of its
    size: orjson returns its output buffer, allocated for a worst case, as the bytes object
    (measured: 127 KiB allocated for 15 KB of text; 5,000 such texts kept, 104 against 87
    MiB resident), so text kept for long is copied out of it once."""
    data = bytes(memoryview(orjson.dumps(value)))
    return orjson.Fragment(data), len(data)


def held(value: Any) -> tuple[Any, int]:
    """A value to keep until the response is written, and about its size: an array or
    object as its text, a scalar as is."""
    if value.__class__ is dict or value.__class__ is list:
        return kept(value)
    return value, len(value) if value.__class__ is str else 8


class JsonArray:
    """An array the engine sends in parts (token IDs, logprobs), held as text until the
    response is written."""

    __slots__ = ("blocks", "parts")

    def __init__(self) -> None:
        self.blocks: list[bytes] = []
        self.parts: list[bytes] = []

    def extend(self, items: list[Any]) -> int:
        """Add ``items``; return the bytes of text that holds."""
        if not items:
            return 0
        parts = self.parts
        part = orjson.dumps(items)[1:-1]  # a slice: a copy of its size (see kept)
        parts.append(part)
        if len(parts) >= PIECES:  # an object per event: joined (``pieces``)
            self.blocks.append(b",".join(parts))
            parts.clear()
        return len(part) + 1

    def fragment(self) -> orjson.Fragment:
        return orjson.Fragment(b"[" + b",".join([*self.blocks, *self.parts]) + b"]")


__all__ = ["JsonArray", "held", "kept", "text"]
