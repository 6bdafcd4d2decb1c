"""Pieces held until whole: text a token at a time, a body or an event a chunk at a time.

A Python object per piece is ~35-50 bytes beside its content, and engines and clients
choose the pieces: one-token deltas, one-line events, two-byte chunks. Held as lists,
they took 5-90x their content (measured, ``docs/measurements.md``, "What one process holds
and does for each input") while ``serving.max_held_bytes`` counted the content. So text
is joined into blocks every ``PIECES`` pieces (``TextPieces``; ``jsontext.JsonArray``
for JSON text) and bytes are folded into one growing buffer past them (``fold``): about
their content, in linear time.
"""

from __future__ import annotations

from sys import getsizeof

PIECES = 64  # pieces held apart before they are joined or folded
PIECE = 57  # bytes of a short ASCII string beside its characters, and its place in a list


def held(pieces: list[bytes], piece: bytes, sep: bytes = b"") -> list[bytes]:
    """``pieces`` with ``piece`` added (to be joined with ``sep``), folded past ``PIECES``."""
    pieces.append(piece)
    return fold(pieces, sep) if len(pieces) > PIECES else pieces


def fold(pieces: list[bytes], sep: bytes) -> list[bytes]:
    """``pieces`` as one buffer (``sep`` between them), the first extended in place: linear
    over any number of folds."""
    head = pieces[0]
    if head.__class__ is not bytearray:
        head = bytearray(head)
    if sep:
        head += sep
    head += sep.join(pieces[1:])
    return [head]  # type: ignore[list-item]  # a bytearray: joined like bytes


class TextPieces:
    """A string the engine sends in pieces (content, reasoning, tool call arguments; the
    reply the prefix index learns), joined into one block every ``PIECES`` pieces.

    Each piece is a Python string of ~50 bytes beside its characters: one-token pieces
    held as a list took 15-90x their characters (measured: 90,000 one-character deltas,
    88 KiB of text, held 5.6 MiB with the reply's copy), and were counted at their
    characters, so that ``serving.max_held_bytes`` saw 1.5% of what a response held.
    ``add`` returns the change in bytes held: a piece's characters and ``PIECE`` until it
    is joined, then the block's own size in place of its pieces' (a non-ASCII piece's
    2-4 bytes a character are counted once joined, at most ``PIECES`` pieces later)."""

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
        if len(parts) < PIECES:
            return n + PIECE
        block = "".join(parts)
        parts.clear()
        self.blocks.append(block)
        # the block in place of the pieces counted before this one
        return getsizeof(block) + 8 - (len(block) - n) - (PIECES - 1) * PIECE

    def text(self) -> str:
        return "".join([*self.blocks, *self.parts])


__all__ = ["PIECE", "PIECES", "TextPieces", "fold", "held"]
