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

from sys import getsizeof
from typing import Any

import orjson

# Parts of an array held as text are joined into one block every so many, so that an
# assembly of one-token events holds about their bytes, not an object per event.
BLOCK = 64
PIECE = 57  # bytes of a short ASCII string beside its characters, and its place in a list


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
        if len(parts) >= BLOCK:
            self.blocks.append(b",".join(parts))
            parts.clear()
        return len(part) + 1

    def fragment(self) -> orjson.Fragment:
        return orjson.Fragment(b"[" + b",".join([*self.blocks, *self.parts]) + b"]")


class TextPieces:
    """A string the engine sends in pieces (content, reasoning, tool call arguments; the
    reply the prefix index learns), joined into one block every ``BLOCK`` pieces.

    Each piece is a Python string of ~50 bytes beside its characters: one-token pieces
    held as a list took 15-90x their characters (measured: 90,000 one-character deltas,
    88 KiB of text, held 5.6 MiB with the reply's copy), and were counted at their
    characters, so that ``serving.max_held_bytes`` saw 1.5% of what a response held.
    ``add`` returns the change in bytes held: a piece's characters and ``PIECE`` until it
    is joined, then the block's own size in place of its pieces' (a non-ASCII piece's
    2-4 bytes a character are counted once joined, at most ``BLOCK`` pieces later)."""

    __slots__ = ("blocks", "parts", "size")

    def __init__(self) -> None:
        self.blocks: list[str] = []
        self.parts: list[str] = []
        self.size = 0  # characters

    def __bool__(self) -> bool:
        """Whether any piece came, an empty one included."""
        return bool(self.parts or self.blocks)

    def add(self, piece: str) -> int:
        """Add ``piece``; return the change in bytes held."""
        parts = self.parts
        parts.append(piece)
        n = len(piece)
        self.size += n
        if len(parts) < BLOCK:
            return n + PIECE
        block = "".join(parts)
        parts.clear()
        self.blocks.append(block)
        # the block in place of the pieces counted before this one
        return getsizeof(block) + 8 - (len(block) - n) - (BLOCK - 1) * PIECE

    def text(self) -> str:
        return "".join([*self.blocks, *self.parts])


__all__ = ["BLOCK", "JsonArray", "TextPieces", "held", "kept", "text"]
