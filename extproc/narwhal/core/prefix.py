"""An approximate prefix-cache index per engine: which prompt blocks Narwhal recently
sent where, so that a projection charges only the prefill an engine still has to do.

Why approximate: the engine's tokenizer, chat template and block boundaries are its
own; what matters to a projection is the *fraction* of a prompt an engine has seen
before. So the prompt is rendered canonically (role and content of each message, in
order) and cut into fixed blocks — of bytes, or of tokens when a tokenizer is configured —
with chained hashes (block i's hash covers blocks 0..i, so one difference ends the match),
and each engine keeps the hashes
it was sent in an LRU with a fixed bound (an unbounded prefix index is a known cause
of router OOMs). An engine that restarts loses its cache; so does its index.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

BLOCK_BYTES = 64  # ~16 tokens at 4 bytes a token: vLLM's block size
BLOCK_TOKENS = 16  # with a tokenizer: vLLM's block size itself


def canonical_prompt(body: dict[str, Any]) -> str | None:
    """The prompt as the index sees it: role and content of each message in order, or the
    text prompt; None for a prompt it cannot cut (token IDs)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content
                                  if isinstance(p, dict) and isinstance(p.get("text"), str))
            parts.append(f"{m.get('role')}\n{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def prompt_blocks(body: dict[str, Any], tokenizer: Any = None) -> tuple[list[int], int, int]:
    """Chained hashes of the canonical prompt's full blocks, the prompt's length and the
    block size in the same unit: bytes (64 a block), or, with a tokenizer (``sizing.
    tokenizer``), tokens (16 a block, as the engine cuts them)."""
    text = canonical_prompt(body)
    if text is None:
        return [], 0, BLOCK_BYTES
    out: list[int] = []
    # vLLM keys a salted prompt's blocks by its salt too: they match only the same salt.
    salt = body.get("cache_salt")
    h = 0 if salt is None else hash(("cache_salt", str(salt)))
    if tokenizer is not None:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        for start in range(0, len(ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            h = hash((h, tuple(ids[start:start + BLOCK_TOKENS])))
            out.append(h)
        return out, len(ids), BLOCK_TOKENS
    data = text.encode()
    for start in range(0, len(data) - BLOCK_BYTES + 1, BLOCK_BYTES):
        h = hash((h, data[start:start + BLOCK_BYTES]))
        out.append(h)
    return out, len(data), BLOCK_BYTES


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

    def resize(self, capacity: int) -> None:
        """A new bound (the engine's cache size became known); the oldest go first."""
        self.capacity = capacity
        while len(self.blocks) > capacity:
            self.blocks.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        self.blocks.clear()
