"""An approximate prefix-cache index per engine: which prompt blocks Narwhal recently
sent where, so that a projection charges only the prefill an engine still has to do.

Why approximate: the engine's tokenizer, chat template and block boundaries are its
own; what matters to a projection is the *fraction* of a prompt an engine has seen
before. So the prompt is rendered canonically (role and content of each message, in
order) and cut into fixed blocks of bytes with chained hashes — block i's hash covers
blocks 0..i, so one differing byte ends the match — and each engine keeps the hashes
it was sent in an LRU with a fixed bound (an unbounded prefix index is a known cause
of router OOMs). An engine that restarts loses its cache; so does its index.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

BLOCK_BYTES = 64  # ~16 tokens at 4 bytes a token: vLLM's block size


def prompt_blocks(body: dict[str, Any]) -> tuple[list[int], int]:
    """Chained hashes of the canonical prompt's full blocks, and its length in bytes."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[bytes] = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content
                                  if isinstance(p, dict) and isinstance(p.get("text"), str))
            parts.append(f"{m.get('role')}\n{content if isinstance(content, str) else ''}\n"
                         .encode())
        data = b"".join(parts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return [], 0
        data = prompt.encode()
    out: list[int] = []
    h = 0
    for start in range(0, len(data) - BLOCK_BYTES + 1, BLOCK_BYTES):
        h = hash((h, data[start:start + BLOCK_BYTES]))
        out.append(h)
    return out, len(data)


class PrefixIndex:
    __slots__ = ("capacity", "blocks", "evictions")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def match(self, hashes: list[int]) -> int:
        """Leading blocks this engine was sent before."""
        n = 0
        blocks = self.blocks
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        if not self.capacity:
            return
        blocks = self.blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        self.blocks.clear()
