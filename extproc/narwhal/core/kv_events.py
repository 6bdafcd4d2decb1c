"""What an engine's KV cache really holds, from the engine's own KV-cache events.

vLLM (``--kv-events-config``, ZMQ publisher) publishes a batch of events whenever its
block pool changes: ``BlockStored`` (full blocks of prompt or output tokens hashed into
the prefix cache, each with its parent, the tokens and the block size), ``BlockRemoved``
(evicted), ``AllBlocksCleared`` (a reset). With them a router knows which prompt blocks
an engine holds instead of guessing from what it sent there (``prefix.PrefixIndex``).

The engine's block hashes are its own (a seeded hash the router cannot recompute), so
each stored block is re-keyed here by a chain over the block's *token IDs* — the chain a
request's prompt IDs produce in ``KvBlocks.match`` — and the engine's hash only names a
block for its removal. A stored block whose parent is unknown (events missed, or a
subscriber that joined late) is not indexed: its chain cannot be known.

Everything an engine sends is bounded: payload size (by the adapter), events per batch,
tokens per event, and the table itself (``capacity`` blocks, oldest dropped first).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

MAX_EVENTS = 65_536  # per batch
MAX_BLOCKS = 4096  # per event
MAX_BLOCK_SIZE = 1024  # tokens
# Per batch, stored and removed together. vLLM publishes a batch per engine step, and a
# step stores (and evicts for) at most its batched tokens: 16,384 blocks and 262,144
# token IDs are four times a 65,536-token step at 16 tokens a block. Each is read in
# Python on the data path's loop: a batch within the payload bound held a million blocks
# and token IDs (measured: 0.3 s to read and 1.1 s to apply, a stall of every request in
# that process); at these bounds, ~30 ms.
MAX_BATCH_BLOCKS = 16_384
MAX_BATCH_TOKENS = 262_144


class KvEventError(ValueError):
    """A batch that is not vLLM's KV-event format."""


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: list[Any]
    parent: Any
    token_ids: list[int]
    block_size: int
    # Per block, whether its hash has extra keys (a cache salt, a LoRA name, multimodal
    # or prompt-embedding identifiers): such a block matches no chain of token IDs alone.
    keyed: tuple[bool, ...] = ()
    medium: str | None = None  # the cache tier (vLLM: "GPU", "CPU", "STORAGE"; None: GPU)


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: list[Any]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared
_DECODER = msgspec.msgpack.Decoder()
_RAW_ARRAY = msgspec.msgpack.Decoder(list[msgspec.Raw])  # an array, its items undecoded
# vLLM's field order, for the array-like form of its events.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")
GPU = "GPU"  # the tier a prompt's prefix hit comes from; other tiers' events are skipped


def _hash(value: Any) -> Any:
    if isinstance(value, bytes) and len(value) <= 64:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise KvEventError(f"block hash must be bytes or an integer, got {type(value).__name__}")


def _hashes(value: Any) -> list[Any]:
    if not isinstance(value, list) or len(value) > MAX_BLOCKS:
        raise KvEventError("block_hashes must be a list of at most "
                           f"{MAX_BLOCKS} hashes")
    return [_hash(h) for h in value]


def _medium(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and len(value) <= 32):
        return value
    raise KvEventError("medium must be a short string or null")


def _keyed(value: Any, blocks: int) -> tuple[bool, ...]:
    """Which blocks have extra keys: ``extra_keys`` is null or one entry per block, each
    null or a list (its contents are not read)."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > blocks:
        raise KvEventError("extra_keys must be a list of at most one entry per block")
    if not all(v is None or isinstance(v, list) for v in value):
        raise KvEventError("extra_keys entries must be lists or null")
    return tuple(v is not None for v in value)


def _event(raw: Any) -> KvEvent | None:
    """One event: a map tagged ``type`` (msgspec's tagged struct), or an array whose first
    item is the tag (the array-like form). Unknown tags are skipped (newer engines)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KvEventError("an event must be a tagged map or array")
    if tag == "BlockStored":
        hashes = _hashes(fields.get("block_hashes"))
        parent = fields.get("parent_block_hash")
        ids = fields.get("token_ids")
        size = fields.get("block_size")
        if not (isinstance(size, int) and not isinstance(size, bool)
                and 0 < size <= MAX_BLOCK_SIZE):
            raise KvEventError(f"block_size must be 1..{MAX_BLOCK_SIZE}")
        if not (isinstance(ids, list) and len(ids) <= min(size * len(hashes), MAX_BATCH_TOKENS)
                and all(type(i) is int for i in ids)):
            raise KvEventError("token_ids must be integers, at most block_size per block")
        return Stored(hashes, None if parent is None else _hash(parent), ids, size,
                      _keyed(fields.get("extra_keys"), len(hashes)),
                      _medium(fields.get("medium")))
    if tag == "BlockRemoved":
        return Removed(_hashes(fields.get("block_hashes")), _medium(fields.get("medium")))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def _decode(decoder: Any, payload: bytes) -> Any:
    try:
        return decoder.decode(payload)
    except msgspec.ValidationError:  # msgpack, but no array where the batch has one
        raise KvEventError("a batch must be [ts, [events...]]") from None
    except (msgspec.DecodeError, RecursionError) as exc:  # nested past msgspec's depth
        raise KvEventError(f"not msgpack: {exc}") from None


def decode_batch(payload: bytes) -> list[KvEvent]:
    """A published batch (``[ts, [events...], dp_rank?]``) as events, in order. Each event
    is decoded when its turn comes (the batch's arrays as raw slices first), so that a
    batch past the bounds is refused after reading about as much as the bounds allow."""
    batch = _decode(_RAW_ARRAY, payload)
    if len(batch) < 2:
        raise KvEventError("a batch must be [ts, [events...]]")
    raw_events = _decode(_RAW_ARRAY, batch[1])
    if len(raw_events) > MAX_EVENTS:
        raise KvEventError(f"more than {MAX_EVENTS} events in one batch")
    events: list[KvEvent] = []
    blocks = tokens = 0
    for r in raw_events:
        e = _event(_decode(_DECODER, r))
        if e is None:
            continue
        if e.__class__ is Stored:
            blocks += len(e.hashes)
            tokens += len(e.token_ids)
        elif e.__class__ is Removed:
            blocks += len(e.hashes)
        if blocks > MAX_BATCH_BLOCKS or tokens > MAX_BATCH_TOKENS:
            raise KvEventError(f"more than {MAX_BATCH_BLOCKS} blocks or {MAX_BATCH_TOKENS} "
                               "token IDs in one batch")
        events.append(e)
    return events


def _link(parent: int, block: list[int]) -> int:
    """A block's chain key: its parent's key and its own tokens. The chain of a prompt
    starts at its block size (blocks of different sizes never match)."""
    return hash((parent, tuple(block)))


def chain(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained keys of the full blocks of ``token_ids`` (block i's covers blocks 0..i)."""
    out: list[int] = []
    h = block_size
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = _link(h, token_ids[start:start + block_size])
        out.append(h)
    return out


class PromptKeys:
    """A prompt's exact token IDs as a KV index matches them: the chain keys of its full
    blocks (the last token left out: the engine always computes it), chained once per
    block size. Chaining 250,000 tokens takes ~10 ms, and placement matches a request on
    every engine with KV events, again at each of the queue's walks while it waits;
    chained at each match, a queue of long prompts cost seconds a walk. The IDs are held
    as 4 bytes each (a list of Python ints: 36-40); the request lets all of it go once
    placed."""

    __slots__ = ("ids", "keys")

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = array("I", ids)  # a tokenizer's IDs are 32-bit
        self.keys: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def chained(self, block_size: int) -> list[int]:
        keys = self.keys.get(block_size)
        if keys is None:
            ids = self.ids
            keys = self.keys[block_size] = chain(ids[:len(ids) - 1], block_size)
        return keys


@dataclass(slots=True)
class Replay:
    """One request to the engine's replay buffer: from batch ``start`` up to live batch
    ``until`` (which is applied after it), or to the buffer's end when None. The buffer
    answers in order; ``takes`` says whether an answer is the next batch to apply, and
    anything else (the end marker, an answer out of order, the live batch reached) ends
    the replay."""

    start: int
    until: int | None = None
    previous: int = -1

    def __post_init__(self) -> None:
        self.previous = self.start - 1

    def takes(self, seq: int) -> bool:
        if seq < 0 or seq <= self.previous or (self.until is not None and seq >= self.until):
            return False
        self.previous = seq
        return True


class KvBlocks:
    """One engine's prefix-cache blocks as its events report them."""

    __slots__ = ("capacity", "stale_s", "by_engine", "held", "block_size", "batches",
                 "errors", "events_at", "pending_since", "unchained", "removed", "last_seq",
                 "complete", "replayed", "replayed_to", "keyed", "keyed_hashes")

    def __init__(self, capacity: int, stale_s: float = 5.0) -> None:
        self.capacity = capacity
        self.stale_s = stale_s
        # the engine's hash -> the block's chain key, oldest first. Ordered for eviction:
        # a plain dict's first key, read after many deletions from its front, is found by
        # walking past them (a batch of a million blocks took 32 s against the bound).
        self.by_engine: OrderedDict[Any, int] = OrderedDict()
        self.held: dict[int, int] = {}  # chain key -> engine blocks with it
        self.block_size = 0  # learnt from the first stored block
        self.batches = 0
        self.errors = 0
        self.unchained = 0  # stored blocks skipped: their parent was never seen
        self.keyed = 0  # stored blocks skipped: keyed by more than tokens (a salt...)
        # Those blocks' engine hashes (bounded): a block stored later as the child of
        # one (vLLM puts a salt in the first block's extra keys only) is keyed too, not
        # a block whose parent was missed.
        self.keyed_hashes: OrderedDict[Any, None] = OrderedDict()
        # Chain keys the engine reported evicting (bounded): known not held.
        self.removed: OrderedDict[int, None] = OrderedDict()
        self.last_seq: int | None = None
        # Every batch since the engine's first (sequence 0) was seen: a block not held is
        # known not cached. Otherwise blocks stored before Narwhal listened are unknown.
        self.complete = False
        self.replayed = 0  # batches recovered from the engine's replay buffer
        # The last batch a replay applied: copies of it and of those before may still
        # arrive live (the subscription was open while the replay ran), and are skipped.
        self.replayed_to: int | None = None
        self.events_at: float | None = None  # when the last batch arrived
        self.pending_since: float | None = None  # first dispatch since that batch

    # -- what the engine says ------------------------------------------------------
    def sequence(self, seq: int, replayed: bool = False) -> None:
        """A batch's sequence number, before it is applied. The engine counts from 0; a
        gap means batches were lost (anything may have been evicted: forget), a restart
        starts again at 0 (its cache is empty: forget, and know everything from here).
        ``replayed``: the batch came from the engine's replay buffer, not live."""
        last = self.last_seq
        if seq == 0:
            if last is not None:
                self.clear()
            self.complete = True
        elif last is None:
            self.complete = False  # listening since the middle of the engine's history
        elif seq != last + 1:
            self.failed()
        self.last_seq = seq
        if replayed:
            self.replayed += 1
            self.replayed_to = seq

    # -- what to ask the engine's replay buffer for (the adapter asks) ---------------
    def resume(self) -> Replay:
        """The replay on subscribing: every buffered batch from the first not seen (0
        before any was seen)."""
        return Replay(0 if self.last_seq is None else self.last_seq + 1)

    def missing(self, seq: int) -> Replay | None:
        """The replay to run before applying live batch ``seq``, if it shows batches
        missed: from 0 for a first batch that is not the engine's first, or for one
        behind the last (the engine restarted and its first batches were lost); from
        after the last for a gap. None when nothing is missing (0 itself is a restart
        heard from its start)."""
        last = self.last_seq
        if seq == 0 or (last is not None and seq == last + 1):
            return None
        return Replay(0 if last is None or seq <= last else last + 1, seq)

    def duplicate(self, seq: int) -> bool:
        """Whether live batch ``seq`` is a copy of one a replay already applied. The first
        live batch past the replay ends the overlap (0 is a restart, never a copy)."""
        to = self.replayed_to
        if to is None:
            return False
        if 0 < seq <= to:
            return True
        self.replayed_to = None
        return False

    def apply(self, events: list[KvEvent], now: float) -> None:
        for ev in events:
            if isinstance(ev, Stored):
                if ev.medium in (None, GPU):
                    self._stored(ev)
            elif isinstance(ev, Removed):
                if ev.medium in (None, GPU):
                    for h in ev.hashes:
                        self._drop(h)
            else:
                self.clear()
        self.batches += 1
        self.events_at = now
        self.pending_since = None

    def _stored(self, ev: Stored) -> None:
        if ev.parent is None:
            key: int | None = ev.block_size
        elif ev.parent in self.keyed_hashes:
            self._keyed(ev.hashes)
            return
        else:
            key = self.by_engine.get(ev.parent)
        if key is None:
            self.unchained += len(ev.hashes)
            return
        self.block_size = ev.block_size
        size = ev.block_size
        for i, h in enumerate(ev.hashes):
            block = ev.token_ids[i * size:(i + 1) * size]
            if len(block) < size:
                return  # vLLM stores full blocks only
            if i < len(ev.keyed) and ev.keyed[i]:
                # A salted (or LoRA, multimodal) block and all after it are not the plain
                # token chain a prompt matches: not indexed, nor their children.
                self._keyed(ev.hashes[i:])
                return
            key = _link(key, block)
            old = self.by_engine.get(h)
            if old == key:
                continue
            if old is not None:
                self._release(old)
            self.by_engine[h] = key
            self.held[key] = self.held.get(key, 0) + 1
            self.removed.pop(key, None)
        while len(self.by_engine) > self.capacity:
            # Forgotten for the table's bound, not evicted by the engine: it may still
            # hold the block, so it is unknown, and the table is no longer the whole
            # history (a walk ending there must not say "known not cached").
            self._release(self.by_engine.popitem(last=False)[1], evicted=False)
            self.complete = False

    def _keyed(self, hashes: list[Any]) -> None:
        self.keyed += len(hashes)
        known = self.keyed_hashes
        for h in hashes:
            known[h] = None
        while len(known) > self.capacity:
            known.popitem(last=False)

    def _drop(self, engine_hash: Any) -> None:
        """The engine evicted the block: gone from both tables (a plain or a keyed one)."""
        self.keyed_hashes.pop(engine_hash, None)
        key = self.by_engine.pop(engine_hash, None)
        if key is not None:
            self._release(key)

    def _release(self, key: int, evicted: bool = True) -> None:
        n = self.held.get(key, 0) - 1
        if n > 0:
            self.held[key] = n
        else:
            self.held.pop(key, None)
            if evicted:
                self.removed[key] = None
                if len(self.removed) > self.capacity:
                    self.removed.popitem(last=False)

    def clear(self) -> None:
        self.by_engine.clear()
        self.keyed_hashes.clear()
        self.held.clear()
        self.removed.clear()

    def restarted(self) -> None:
        """The engine may have restarted (it was down and came back): its cache is gone,
        and its sequence starts again at 0. Sequence numbers alone cannot say so when the
        new history's first batches were lost and the old one was short (new 1 after old
        0 looks like the next batch), so the health checks say it: forget the blocks and
        the sequence; the next batch heard starts the history again (from 0 by replay)."""
        self.clear()
        self.complete = False
        self.last_seq = None
        self.replayed_to = None

    def failed(self) -> None:
        """A batch that could not be read, or a gap in the sequence: what was missed may
        have removed anything, so nothing held is known any more."""
        self.errors += 1
        self.clear()
        self.complete = False

    # -- what the router asks ------------------------------------------------------
    def dispatched(self, now: float, prompt: PromptKeys | None = None) -> None:
        """A request was placed here: a batch is due within a step or two (``live``) if
        its prompt has a whole block the engine does not hold. With its IDs known and no
        such block (a cached prefix and a tail shorter than a block: a shared system
        prompt and a short question, with vLLM CPU's 128-token blocks) the engine stores
        and publishes nothing, and arming on it read the events as stopped ``stale_s``
        later, every prediction falling back to the index until the next batch (seen
        against vLLM: a repeated question 5 s after the last batch predicted 1,196 cached
        tokens where vLLM found 1,152). Unknown IDs arm it, as any dispatch did."""
        if self.pending_since is not None:
            return
        if prompt is not None and self.block_size:
            held, _ = self.match(prompt)
            if len(prompt.chained(self.block_size)) * self.block_size <= held:
                return
        self.pending_since = now

    def live(self, now: float) -> bool:
        """Events are flowing: some have come, and none is overdue after a dispatch (an
        engine that computes a prompt stores its blocks within a step or two)."""
        if self.events_at is None:
            return False
        return self.pending_since is None or now - self.pending_since <= self.stale_s

    def match(self, prompt: PromptKeys) -> tuple[int, bool]:
        """Prompt tokens the engine holds as a cached prefix (whole blocks; never the
        last prompt token, which the engine always computes), and whether that is known:
        the walk ended at a block the engine reported evicting, at the prompt's end, or
        with the engine's whole history seen. Else the first missing block may have been
        stored before Narwhal listened (vLLM reports no cache hits), and another estimate
        may know better."""
        size = self.block_size
        if not size:
            return 0, self.complete
        n = 0
        held = self.held
        known = True
        for key in prompt.chained(size):
            if key not in held:
                known = self.complete or key in self.removed
                break
            n += 1
        return n * size, known
