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

Replies too: an engine hashes and caches every full block of a sequence, the generated
ones included (vLLM v1), so the next turn of a conversation, whose prompt carries the
reply, finds the reply cached where it was generated. A request that completes adds its
reply to the chain its prompt began (``Chain``, ``ReplyText``, ``reply_blocks``): the
blocks a follow-up's canonical prompt will have, in the same unit and chain.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .pieces import TextPieces
from .tokens import encode

BLOCK_BYTES = 64  # ~16 tokens at 4 bytes a token: vLLM's block size
BLOCK_TOKENS = 16  # with a tokenizer: vLLM's block size itself
# The most of a reply kept to extend its prompt's chain (~16k tokens); what a longer
# reply adds past it is not indexed. Bounds the per-request memory and hashing.
REPLY_MAX_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Chain:
    """Where a prompt's block chain stops: the last full block's hash (or the chain's
    seed), the partial block after it, and whether a reply is rendered as a chat turn."""

    last: int
    tail: bytes | tuple[int, ...]
    chat: bool


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


def prompt_blocks(body: dict[str, Any], tokenizer: Any = None
                  ) -> tuple[list[int], int, int, Chain | None]:
    """Chained hashes of the canonical prompt's full blocks, the prompt's length and the
    block size in the same unit: bytes (64 a block), or, with a tokenizer (``sizing.
    tokenizer``), tokens (16 a block, as the engine cuts them); and where the chain
    stops, for the reply to continue it."""
    text = canonical_prompt(body)
    if text is None:
        return [], 0, BLOCK_BYTES, None
    # vLLM keys a salted prompt's blocks by its salt too: they match only the same salt.
    salt = body.get("cache_salt")
    seed = 0 if salt is None else hash(("cache_salt", str(salt)))
    chat = isinstance(body.get("messages"), list)
    if tokenizer is not None:
        ids = tuple(encode(tokenizer, text))
        out, last = _chain(seed, ids, BLOCK_TOKENS)
        return out, len(ids), BLOCK_TOKENS, Chain(last, ids[len(out) * BLOCK_TOKENS:], chat)
    data = text.encode()
    out, last = _chain(seed, data, BLOCK_BYTES)
    return out, len(data), BLOCK_BYTES, Chain(last, data[len(out) * BLOCK_BYTES:], chat)


def _chain(h: int, units: bytes | tuple[int, ...], size: int) -> tuple[list[int], int]:
    """Chained hashes of the full blocks of ``units`` (bytes, or token IDs), from ``h``."""
    out: list[int] = []
    for start in range(0, len(units) - size + 1, size):
        h = hash((h, units[start:start + size]))
        out.append(h)
    return out, h


def reply_blocks(chain: Chain, reply: str, tokenizer: Any = None) -> list[int]:
    """The blocks a reply adds to its prompt's chain, as a follow-up turn renders it
    (canonically: the assistant message after the prompt's; a completion's text right
    after its prompt)."""
    text = f"assistant\n{reply}\n" if chain.chat else reply
    if isinstance(chain.tail, tuple):
        if tokenizer is None:
            return []
        ids = chain.tail + tuple(encode(tokenizer, text))
        return _chain(chain.last, ids, BLOCK_TOKENS)[0]
    return _chain(chain.last, chain.tail + text.encode(), BLOCK_BYTES)[0]


class ReplyText(TextPieces):
    """A response's generated text (the first choice's), as its events pass: what the
    prefix index adds when the request completes. Bounded by ``REPLY_MAX_BYTES``
    characters; ``held``, the bytes it holds, counts against ``serving.max_held_bytes``
    with the rest of its response. ``event`` runs for every token event: direct lookups,
    a malformed event skipped."""

    __slots__ = ("held", "chat")

    def __init__(self, chat: bool) -> None:
        super().__init__()
        self.held = 0
        self.chat = chat

    def event(self, event: dict[str, Any]) -> None:
        try:
            choice = event["choices"][0]
            piece = choice["delta"]["content"] if self.chat else choice["text"]
        except (KeyError, IndexError, TypeError):
            return
        if piece.__class__ is str and piece and self.size < REPLY_MAX_BYTES:
            self.held += self.add(piece)

    def text(self) -> str:
        return super().text()[:REPLY_MAX_BYTES]


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
        newest = blocks.move_to_end
        for h in hashes:  # each becomes the newest, the last of them most recent
            blocks[h] = None  # a new block joins at the end, a known one keeps its place
            newest(h)  # (and is moved there; -40% against asking first which it is)
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
