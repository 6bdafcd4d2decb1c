"""Engines' KV-cache events: the wire format, the reported blocks, and their use in
projections, on a fake clock. The wire bytes are built the way vLLM's publisher builds
them (msgspec msgpack of ``[ts, [tagged events], dp_rank]``); the real-vLLM tier checks
the same path against vLLM itself."""

from __future__ import annotations

import asyncio
import collections
import contextlib

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.config import parse
from narwhal.core.chat_prompt import PromptIds
from narwhal.core.engines import EngineState
from narwhal.core.kv_events import KvBlocks, KvEventError, PromptKeys, Replay, chain, decode_batch
from narwhal.core.placement import project
from narwhal.core.pool import Scrape
from narwhal.core.router import Router
from narwhal.core.scheduler import Ticket
from narwhal.server import kv_events as loop_module

BS = 4  # a small block size keeps the token lists readable


def stored(hashes, parent, ids, size=BS):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": ids, "block_size": size, "lora_id": None, "medium": "GPU",
            "lora_name": None}


def removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def batch(*events) -> bytes:
    return msgspec.msgpack.encode([1796277002.88, list(events), 0])


def test_stored_blocks_chain_across_events_and_match_a_prompt():
    kv = KvBlocks(100)
    kv.apply(decode_batch(batch(stored([b"h1", b"h2"], None, [1, 2, 3, 4, 5, 6, 7, 8]))), 1.0)
    kv.apply(decode_batch(batch(stored([b"h3"], b"h2", [9, 10, 11, 12]))), 2.0)
    prompt = list(range(1, 13)) + [99, 98]
    assert kv.match(PromptKeys(prompt))[0] == 12 and kv.block_size == BS
    assert kv.match(PromptKeys([1, 2, 3, 4, 0, 0, 0, 0, 9]))[0] == 4  # one different block ends it
    assert kv.match(PromptKeys([9, 10, 11, 12, 1]))[0] == 0  # a block is its whole prefix, not its tokens


def test_the_last_prompt_token_is_never_a_hit():
    kv = KvBlocks(100)
    kv.apply(decode_batch(batch(stored([b"a", b"b"], None, list(range(8))))), 1.0)
    assert kv.match(PromptKeys(list(range(8))))[0] == 4  # the engine computes the last token itself
    assert kv.match(PromptKeys(list(range(9))))[0] == 8


def test_removed_and_cleared_forget_blocks():
    kv = KvBlocks(100)
    kv.apply(decode_batch(batch(stored([b"a", b"b"], None, list(range(8))))), 1.0)
    kv.apply(decode_batch(batch(removed([b"b"]))), 2.0)
    assert kv.match(PromptKeys(list(range(9)))) == (4, True)  # known: the engine evicted block 2
    kv.apply(decode_batch(batch({"type": "AllBlocksCleared"})), 3.0)
    assert kv.match(PromptKeys(list(range(9))))[0] == 0 and not kv.by_engine and not kv.held


def test_a_history_seen_from_the_engines_start_is_complete_and_a_gap_ends_that():
    kv = KvBlocks(100)
    kv.sequence(0)  # the engine's first batch: everything it holds, Narwhal saw stored
    kv.apply(decode_batch(batch(stored([b"a"], None, [1, 2, 3, 4]))), 1.0)
    assert kv.complete and kv.match(PromptKeys([1, 2, 3, 4, 5, 6, 7, 8, 9])) == (4, True)
    kv.sequence(1)
    kv.sequence(3)  # batch 2 was lost: it may have evicted anything
    assert not kv.complete and not kv.held and kv.errors == 1
    kv.apply(decode_batch(batch(stored([b"a"], None, [1, 2, 3, 4]))), 2.0)
    assert kv.match(PromptKeys([1, 2, 3, 4, 5, 6, 7, 8, 9])) == (4, False)  # block 2: unknown now
    kv.sequence(0)  # the engine restarted: its cache is empty, its history complete again
    assert kv.complete and not kv.held


def test_what_a_replay_asks_for_and_which_live_batches_it_already_applied():
    kv = KvBlocks(100)
    assert kv.resume() == Replay(0) and kv.missing(5) == Replay(0, 5)
    assert kv.missing(0) is None
    for seq in range(3):  # the engine's buffer, from its first batch
        kv.sequence(seq, replayed=True)
    assert kv.complete and kv.replayed == 3 and kv.resume() == Replay(3)
    # The subscription was open while the replay ran: live copies of 1 and 2 follow.
    assert kv.duplicate(1) and kv.duplicate(2)
    assert not kv.duplicate(3) and kv.missing(3) is None  # the first live one past it
    kv.sequence(3)
    assert not kv.duplicate(2)  # the overlap is over: an old number is not a copy now
    assert kv.missing(5) == Replay(4, 5)  # a gap: replay 4, then apply 5
    # Behind the last: the engine restarted and its first batches were lost; its buffer
    # holds its new history from 0.
    assert kv.missing(2) == Replay(0, 2)
    assert not kv.duplicate(0) and kv.missing(0) is None  # a restart heard from its start


def test_a_replay_takes_the_next_batches_in_order_up_to_the_live_one():
    r = Replay(4, 9)
    assert not r.takes(3)  # before the start
    assert r.takes(4) and r.takes(6)  # the buffer may have lost some: the core sees it
    assert not r.takes(6) and not r.takes(5)  # again, or backwards: ends it
    assert not r.takes(9) and not r.takes(-1)  # the live batch reached; the end marker
    assert Replay(0).takes(10**6)  # to the buffer's end


def test_listening_from_the_middle_leaves_unseen_blocks_unknown():
    kv = KvBlocks(100)
    kv.sequence(41)
    kv.apply(decode_batch(batch(stored([b"a"], None, [1, 2, 3, 4]))), 1.0)
    assert not kv.complete and kv.match(PromptKeys([5, 6, 7, 8, 9])) == (0, False)


def test_a_block_whose_parent_was_never_seen_is_not_indexed():
    kv = KvBlocks(100)
    kv.apply(decode_batch(batch(stored([b"c"], b"unknown", [1, 2, 3, 4]))), 1.0)
    assert kv.unchained == 1 and not kv.by_engine


def test_the_table_is_bounded_and_what_it_forgets_is_unknown_not_evicted():
    kv = KvBlocks(3)
    kv.sequence(0)  # the whole history, until the bound forgets some of it
    ids = list(range(40))
    kv.apply(decode_batch(batch(stored([bytes([i]) for i in range(10)], None, ids))), 1.0)
    assert len(kv.by_engine) == 3 and len(kv.held) == 3 and not kv.removed
    # The engine still holds the first blocks: the table cannot say they are not cached.
    assert not kv.complete and kv.match(PromptKeys([*ids, 99])) == (0, False)
    salted = stored([bytes([100 + i]) for i in range(10)], None, ids)
    kv.apply(decode_batch(batch(salted | {"extra_keys": [["s"]] + [None] * 9})), 2.0)
    assert kv.keyed == 10 and len(kv.keyed_hashes) == 3  # salted hashes: bounded too


def test_salted_blocks_and_other_tiers_are_not_the_prompts_plain_chain():
    """vLLM keys a block by its extra keys too (a cache salt, a LoRA name, multimodal
    identifiers): a salted block matches no plain prompt, nor do the blocks after it; and
    a CPU or storage tier's stores and removals say nothing of the GPU cache a hit
    comes from. The array-like form carries the same fields in vLLM's order."""
    kv = KvBlocks(100)
    kv.sequence(0)
    ids = list(range(8))
    salted = stored([b"s1", b"s2"], None, ids) | {"extra_keys": [["tenant-a"], None]}
    kv.apply(decode_batch(batch(salted)), 1.0)
    # A later child of a salted block (vLLM salts the first block's extra keys only) is
    # salted too: counted keyed, not as a block whose parent was missed; once the engine
    # evicts the salted block, a child of its hash is a missed parent again.
    kv.apply(decode_batch(batch(stored([b"s3"], b"s2", [8, 9, 10, 11]))), 1.0)
    kv.apply(decode_batch(batch(stored([b"s4"], b"s3", [12, 13, 14, 15]))), 1.0)
    assert kv.keyed == 4 and kv.unchained == 0 and not kv.by_engine
    kv.apply(decode_batch(batch(removed([b"s3"]))), 1.0)
    kv.apply(decode_batch(batch(stored([b"s5"], b"s3", [16, 17, 18, 19]))), 1.0)
    assert kv.keyed == 4 and kv.unchained == 1 and not kv.by_engine
    assert kv.match(PromptKeys([*ids, 99])) == (0, True)  # the plain prompt is not cached
    kv.apply(decode_batch(batch(stored([b"p1"], None, ids[:4], size=BS)
                                | {"medium": "CPU"})), 1.0)
    assert not kv.by_engine  # offloaded to CPU: not a GPU prefix hit
    kv.apply(decode_batch(batch(stored([b"p1"], None, ids[:4]) | {"medium": "GPU"})), 1.0)
    kv.apply(decode_batch(batch(removed([b"p1"]) | {"medium": "CPU"})), 1.0)
    assert kv.match(PromptKeys([*ids, 99])) == (BS, True)  # the CPU copy's removal: still on GPU
    array = ["BlockStored", [b"a1"], None, [1, 2, 3, 4], BS, None, "GPU", None, [["s"]]]
    (ev,) = decode_batch(msgspec.msgpack.encode([1.0, [array]]))
    assert ev.keyed == (True,) and ev.medium == "GPU"


def test_a_salted_prompt_has_its_own_index_blocks():
    from narwhal.core.prefix import prompt_blocks

    body = {"messages": [{"role": "system", "content": "x" * 300}]}
    plain = prompt_blocks(body)[0]
    salted = prompt_blocks(body | {"cache_salt": "a"})[0]
    assert plain and salted and not set(plain) & set(salted)
    assert prompt_blocks(body | {"cache_salt": "a"})[0] == salted
    assert prompt_blocks(body | {"cache_salt": "b"})[0] != salted


def test_integer_hashes_and_unknown_event_types_are_accepted():
    events = decode_batch(batch(stored([7, 8], None, list(range(8))), {"type": "Future"}))
    assert len(events) == 1 and events[0].hashes == [7, 8]


@pytest.mark.parametrize("payload, message", [
    (b"\xc1", "not msgpack"),
    (b"\x91" * 100_000 + b"\xc0", "not msgpack"),  # nested past the decoder's depth
    (msgspec.msgpack.encode({"a": 1}), "batch must be"),
    (batch(stored([b"a"], None, [1, 2, 3, 4], size=0)), "block_size"),
    (batch(stored([b"a"], None, [1, 2, 3, 4], size=True)), "block_size"),
    (batch(stored([b"a"], None, [1, 2, 3, 4, 5])), "token_ids"),
    (batch(stored([b"a"], None, [1, 2, "x", 4])), "token_ids"),
    (batch(stored([1.5], None, [1, 2, 3, 4])), "block hash"),
    (batch(stored("abc", None, [1, 2, 3, 4])), "block_hashes"),
    (batch(stored([b"x" * 65], None, [1, 2, 3, 4])), "block hash"),
    (batch(42), "tagged"),
    (batch(stored([b"a"], None, [1, 2, 3, 4]) | {"extra_keys": [None, None]}), "extra_keys"),
    (batch(stored([b"a"], None, [1, 2, 3, 4]) | {"extra_keys": ["salt"]}), "extra_keys"),
    (batch(stored([b"a"], None, [1, 2, 3, 4]) | {"medium": "x" * 40}), "medium"),
])
def test_malformed_batches_are_refused(payload, message):
    with pytest.raises(KvEventError, match=message):
        decode_batch(payload)


def test_a_batch_is_bounded_in_blocks_and_token_ids_together():
    """Each block is read in Python on the data path's loop: a batch within the payload
    bound held a million blocks (1.4 s). A batch is refused past 16,384 blocks, stored and
    removed together, or 262,144 token IDs, and accepted up to them."""
    from narwhal.core.kv_events import MAX_BATCH_BLOCKS, MAX_BATCH_TOKENS, MAX_BLOCKS

    full = [stored(list(range(i, i + MAX_BLOCKS)), None, list(range(MAX_BLOCKS)), size=1)
            for i in range(0, MAX_BATCH_BLOCKS - MAX_BLOCKS, MAX_BLOCKS)]
    at = [*full, removed(list(range(MAX_BLOCKS)))]
    assert len(decode_batch(batch(*at))) == MAX_BATCH_BLOCKS // MAX_BLOCKS
    with pytest.raises(KvEventError, match="more than 16384 blocks"):
        decode_batch(batch(*at, removed([1])))
    tokens = [stored([i], None, list(range(1024)), size=1024) for i in range(256)]
    assert sum(len(e.token_ids) for e in decode_batch(batch(*tokens))) == MAX_BATCH_TOKENS
    with pytest.raises(KvEventError, match="262144 token IDs"):
        decode_batch(batch(*tokens, stored([9], None, [1], size=1)))


def test_a_batch_past_the_table_keeps_its_newest_blocks():
    """The table's oldest blocks leave first, in order, however many a batch brings (a
    plain dict's first key after many deletions was found by walking past them)."""
    kv = KvBlocks(100)
    ids = list(range(300))
    kv.apply(decode_batch(batch(stored(list(range(300)), None, ids, size=1))), 0.0)
    assert list(kv.by_engine) == list(range(200, 300))
    assert kv.match(PromptKeys(ids[:1]))[0] == 0 and not kv.complete


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_only_ever_raise_kv_event_error(data):
    with contextlib.suppress(KvEventError):
        decode_batch(data)


def test_events_are_live_until_one_is_overdue_after_a_dispatch():
    kv = KvBlocks(100, stale_s=5.0)
    assert not kv.live(0.0)  # nothing heard yet
    kv.apply([], 10.0)
    assert kv.live(100.0)  # an idle engine sends nothing, and nothing changed
    kv.dispatched(100.0)
    assert kv.live(105.0) and not kv.live(105.1)
    kv.apply([], 106.0)
    assert kv.live(200.0)


def test_a_dispatch_that_stores_no_whole_block_leaves_the_events_live():
    """A batch is due after a dispatch only where the prompt has a whole block the engine
    does not hold: a prompt whose whole blocks are all held (a cached prefix, a tail
    shorter than a block) makes the engine publish nothing, and must not read as the
    events having stopped once ``stale_s`` has passed. Unknown IDs arm the check."""
    kv = KvBlocks(100, stale_s=5.0)
    kv.apply(decode_batch(batch(stored([b"a", b"b"], None, list(range(8))))), 10.0)
    kv.dispatched(100.0, PromptKeys([*range(8), 50, 51, 52]))  # 2 whole blocks, both held
    kv.dispatched(101.0, PromptKeys(list(range(9))))  # the same prefix, its last token
    kv.dispatched(102.0, PromptKeys([0, 1, 2]))  # no whole block at all
    assert kv.live(200.0)
    kv.dispatched(103.0, PromptKeys([*range(8), 50, 51, 52, 53, 54]))  # a third block: new
    assert kv.live(108.0) and not kv.live(108.1)
    kv.apply([], 110.0)  # the batch came
    assert kv.live(200.0)
    kv.dispatched(201.0, None)  # IDs unknown: armed, as any dispatch was
    assert not kv.live(206.1)
    empty = KvBlocks(100, stale_s=5.0)  # nothing stored yet: no block size to judge by
    empty.apply([], 1.0)
    empty.dispatched(2.0, PromptKeys(list(range(3))))
    assert not empty.live(7.1)


def test_placement_arms_the_events_check_with_the_placed_prompt():
    now = [100.0]
    router, e = engine_with_two_blocks(now)
    held = Ticket(object(), 10, now[0], 30.0, now[0] + 60)
    held.prompt_ids = PromptKeys([*range(8), 99, 98])  # its whole blocks are the engine's
    assert router.scheduler._place(held, now[0], [project(e, held, now=now[0])]) is e
    assert held.prompt_ids is None  # let go once placed, as before
    now[0] += 6.0
    assert e.kv.live(now[0])  # nothing was due from it
    new = Ticket(object(), 13, now[0], 30.0, now[0] + 60)
    new.prompt_ids = PromptKeys([*range(8), 7, 7, 7, 7, 1])  # a third whole block
    assert router.scheduler._place(new, now[0], [project(e, new, now=now[0])]) is e
    now[0] += 6.0
    assert not e.kv.live(now[0])  # its block never came: the events are overdue


def router_with_events(clock) -> Router:
    r = Router(parse({"engines": [
        {"name": "a", "url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:5557"}]}),
        clock=clock)
    for e in r.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = clock()
    r.started = True
    return r


def engine_with_two_blocks(now: list[float]) -> tuple[Router, EngineState]:
    """A router on a fake clock whose one engine reported two blocks of tokens 0-7."""
    router = router_with_events(lambda: now[0])
    e = router.engines[0]
    assert e.kv is not None
    router.pool.observe_kv_events(e, batch(stored([b"a", b"b"], None, list(range(8)))), now[0])
    return router, e


def test_projection_counts_only_the_reported_uncached_prompt_and_falls_back_when_stale():
    now = [100.0]
    router, e = engine_with_two_blocks(now)
    assert e.kv is not None
    t = Ticket(object(), 10, now[0], 1.0, now[0] + 60)
    t.prompt_ids = PromptKeys(list(range(10)))
    c = project(e, t, now=now[0])
    assert c.cached == pytest.approx(0.8) and c.work == pytest.approx(2.0)
    # Heard from the middle of the engine's history, where the reported blocks end
    # unknown, what Narwhal sent there may say more (it said nothing here: 0.8 stays).
    assert not e.kv.complete and project(e, t, now=now[0]).cached == pytest.approx(0.8)
    e.kv.dispatched(now[0])
    now[0] += 6.0  # events stopped: the approximate index (empty here) decides again
    assert project(e, t, now=now[0]).cached == 0.0
    with pytest.raises(KvEventError):
        router.pool.observe_kv_events(e, b"\xc1", now[0])
    assert e.kv.errors == 1 and not e.kv.by_engine


def test_a_prompt_is_chained_once_per_block_size_and_let_go_once_placed(monkeypatch):
    """Matching chained a prompt's IDs each time (~10 ms for 250,000 tokens): on every
    engine with KV events, again at each of the queue's walks while the request waited,
    and the IDs were a list of Python ints held to the request's end. Chained once per
    block size, the IDs held at 4 bytes each; all of it let go once the request is
    placed, and what it holds until then counted with the request."""
    import tracemalloc

    from narwhal.core import kv_events

    now = [100.0]
    router = router_with_events(lambda: now[0])
    e = router.engines[0]
    router.pool.observe_kv_events(e, batch(stored([b"a", b"b"], None, list(range(8)))), now[0])
    chained: list[int] = []
    real = kv_events.chain
    monkeypatch.setattr(kv_events, "chain",
                        lambda ids, size: chained.append(size) or real(ids, size))
    t = Ticket(object(), 10, now[0], 1.0, now[0] + 60)
    t.prompt_ids = PromptKeys(list(range(10)))
    assert t.held() == 10 * 8
    for _ in range(5):
        assert project(e, t, now=now[0]).cached == pytest.approx(0.8)
    assert chained == [BS]
    assert e.kv.match(PromptKeys([9, *range(1, 10)])) == (0, False) and chained == [BS, BS]
    assert router.scheduler.admit(t, now[0]).engine is e and t.prompt_ids is None
    ids = list(range(1000, 101_000))
    tracemalloc.start()
    keys = PromptKeys(ids)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(keys) == len(ids) and held < 4.1 * len(ids)


def test_chain_is_over_whole_blocks_only():
    assert len(chain(list(range(11)), 4)) == 2
    assert chain([1, 2, 3, 4], 4) != chain([1, 2, 3, 4], 2)[:1]


class Tok:
    """A stand-in tokenizer: one ID per character (the template is under test here)."""

    class Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode_batch(self, texts, add_special_tokens=False):
        return [self.Enc([ord(c) for c in text]) for text in texts]


def test_chat_prompt_renders_the_template_in_the_engines_content_format():
    plain = PromptIds(Tok(), "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                      "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}", {})
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert not plain.parts
    assert "".join(map(chr, plain.ids(body, True))) == "<user>hi<a>"
    # A template that loops over a message's content gets parts (vLLM's "openai" format).
    parts = PromptIds(Tok(), "{% for m in messages %}{% for p in m.content %}{{ p.text }}"
                      "{% endfor %}{% endfor %}", {})
    assert parts.parts and "".join(map(chr, parts.ids(body, True))) == "hi"
    assert plain.ids({"messages": [{"role": "user", "content": [{"type": "image"}]}]},
                     True) is None
    raising = PromptIds(Tok(), "{{ raise_exception('no') }}", {})
    assert raising.ids(body, True) is None  # that request is matched approximately
    assert "".join(map(chr, plain.ids({"prompt": "abc"}, False))) == "abc"


def test_where_reported_blocks_are_unknown_the_index_may_say_more_and_not_otherwise():
    now = [100.0]
    router = router_with_events(lambda: now[0])
    e = router.engines[0]
    assert e.kv is not None
    router.pool.observe_kv_events(e, batch(stored([b"x"], None, [7, 7, 7, 7])), now[0], 12)
    t = Ticket(object(), 100, now[0], 1.0, now[0] + 60)
    t.prompt_ids = PromptKeys(list(range(100)))  # not among the reported blocks
    t.blocks, t.block_units, t.prompt_units = [11, 12, 13], 16, 100
    e.prefix.insert([11, 12, 13])  # Narwhal sent this prompt's first 48 tokens there
    assert project(e, t, now=now[0]).cached == pytest.approx(0.48)  # listening mid-history
    router.pool.observe_kv_events(e, batch(stored([b"y"], None, [7, 7, 7, 7])), now[0], 0)
    # The engine restarted and every batch since was seen: not reported is not cached.
    assert e.kv.complete and project(e, t, now=now[0]).cached == 0.0


def test_with_events_overdue_and_no_index_the_engines_hit_rate_is_the_estimate():
    now = [100.0]
    router = Router(parse({"scheduler": {"prefix_index_blocks": 0}, "engines": [
        {"name": "a", "url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:5557"}]}),
        clock=lambda: now[0])
    e = router.engines[0]
    assert e.kv is not None
    e.model.hit_rate = 0.5  # what the engine's own prefix-cache counters say
    router.pool.observe_kv_events(e, batch(stored([b"a"], None, [1, 2, 3, 4])), now[0], 0)
    t = Ticket(object(), 100, now[0], 1.0, now[0] + 60)
    t.prompt_ids = PromptKeys(list(range(100)))
    assert project(e, t, now=now[0]).work == pytest.approx(100.0)  # known: nothing cached
    e.kv.dispatched(now[0])
    now[0] += 6.0  # events overdue: neither the reported blocks nor an index can say
    c = project(e, t, now=now[0])
    assert c.cached == 0.0 and c.work == pytest.approx(50.0)


def test_a_subscriber_that_fails_subscribes_again(monkeypatch):
    """An unforeseen failure while reading (here injected once into the pool) must not
    end the engine's events: the loop subscribes again and reads the next batches."""
    monkeypatch.setattr(loop_module, "RESUBSCRIBE_S", (0.01, 0.01))
    pub = Publisher()
    router = _replaying(pub, replay=False)
    e = router.engines[0]
    real = router.pool.observe_kv_events
    failures = []

    def fail_once(*args, **kw):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected")
        real(*args, **kw)

    monkeypatch.setattr(router.pool, "observe_kv_events", fail_once)

    async def body(task):
        await _publish_until(pub, lambda: e.kv.batches >= 1, task)

    _run_with(pub, router, body)
    assert failures and e.kv.batches >= 1


def test_the_resubscribe_wait_doubles_for_repeated_failures_and_starts_over_after_a_long_run():
    first, longest = loop_module.RESUBSCRIBE_S
    waits = [loop_module.resubscribe_wait(None, 0.0)]
    for _ in range(8):  # failures one after another, each as soon as it subscribed
        waits.append(loop_module.resubscribe_wait(waits[-1], 0.1))
    assert waits[:3] == [first, 2 * first, 4 * first]
    assert waits[-1] == longest and max(waits) == longest
    # a subscription that ran longer than the longest wait, then failed: a new fault
    assert loop_module.resubscribe_wait(longest, longest + 1.0) == first
    assert loop_module.resubscribe_wait(longest, longest / 2) == longest


def chain_batch(k: int) -> bytes:
    """Batch ``k`` of a history whose blocks chain: block k holds tokens k*BS..k*BS+3."""
    parent = None if k == 0 else f"b{k - 1}".encode()
    return batch(stored([f"b{k}".encode()], parent, list(range(k * BS, (k + 1) * BS))))


class Publisher:
    """vLLM's ZMQ publisher as its code behaves (``ZmqEventPublisher``): a PUB socket for
    live batches, ``[topic, seq, payload]``, and a ROUTER replay socket answering
    ``[b"", start]`` with every buffered batch from ``start`` and an end marker."""

    END = (-1).to_bytes(8, "big", signed=True)

    def __init__(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.requests: list[int] = []
        self.answer = True  # False: a replay socket that never answers

    async def publish(self, payload: bytes, live: bool = True) -> int:
        seq = len(self.buffer)
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        return seq

    async def serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            if not self.answer:
                continue
            for seq, payload in self.buffer:
                if seq >= self.requests[-1]:
                    await self.router.send_multipart(
                        [client, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", self.END, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


def _replaying(pub: Publisher, replay: bool = True) -> Router:
    engine = {"name": "a", "url": "http://127.0.0.1:1",
              "kv_events": f"tcp://127.0.0.1:{pub.port}"}
    if replay:
        engine["kv_replay"] = f"tcp://127.0.0.1:{pub.replay_port}"
    return Router(parse({"engines": [engine]}))


async def _until(predicate, task: asyncio.Task) -> None:
    while not predicate():
        assert not task.done(), task
        await asyncio.sleep(0.005)


async def _publish_until(pub: Publisher, predicate, task: asyncio.Task) -> None:
    """Publish live batches until ``predicate``: a PUB socket drops what it sends before
    the subscription reaches it, so how many are lost is not known in advance."""
    while not predicate():
        assert not task.done(), task
        await pub.publish(chain_batch(len(pub.buffer)))
        await asyncio.sleep(0.01)


def _run_with(pub: Publisher, router: Router, body) -> None:
    async def run() -> None:
        server = asyncio.ensure_future(pub.serve())
        task = asyncio.ensure_future(loop_module.kv_events_loop(router, router.engines[0]))
        try:
            await body(task)
        finally:
            for t in (task, server):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    try:
        asyncio.run(run())
    finally:
        pub.close()


def test_a_subscriber_started_after_the_engine_replays_its_history():
    """Batches the engine published before Narwhal subscribed (Narwhal started later)
    come from the replay buffer: the history is complete, every block known."""
    pub = Publisher()
    router = _replaying(pub)
    kv = router.engines[0].kv

    async def body(task):
        for k in range(3):
            await pub.publish(chain_batch(k), live=False)  # nobody listening yet
        await _until(lambda: kv.replayed == 3, task)
        assert pub.requests == [0] and kv.complete and kv.errors == 0
        assert kv.match(PromptKeys(list(range(3 * BS + 1)))) == (3 * BS, True)
        await _publish_until(pub, lambda: kv.last_seq is not None and kv.last_seq >= 5, task)

    _run_with(pub, router, body)
    assert kv.complete and kv.errors == 0 and kv.unchained == 0
    n = kv.last_seq + 1
    assert kv.match(PromptKeys(list(range(n * BS + 1)))) == (n * BS, True)  # no batch missed


def test_live_batches_lost_before_the_subscription_took_hold_are_replayed():
    """The engine's first live batches reach no subscriber (ZMQ's slow joiner): the first
    one that arrives shows the gap, and the replay fills it before it is applied."""
    pub = Publisher()
    router = _replaying(pub)
    kv = router.engines[0].kv

    async def body(task):
        await _until(lambda: pub.requests, task)  # the first replay: nothing buffered
        await _publish_until(pub, lambda: kv.last_seq is not None, task)
        assert kv.complete and kv.errors == 0

    _run_with(pub, router, body)
    assert kv.replayed == kv.last_seq  # every batch before the first one heard live
    assert kv.match(PromptKeys(list(range((kv.last_seq + 1) * BS + 1))))[0] == (kv.last_seq + 1) * BS


def test_an_engine_restart_whose_first_batches_were_lost_is_replayed_from_its_start():
    """The engine restarts (its sequence starts again at 0, its cache empty) and the
    subscriber misses its first batches: the first one heard is behind the last, so the
    replay starts at 0 and the new history is complete, the old blocks forgotten."""
    pub = Publisher()
    router = _replaying(pub)
    kv = router.engines[0].kv

    async def body(task):
        await _publish_until(pub, lambda: kv.last_seq is not None and kv.last_seq >= 3, task)
        assert kv.complete and kv.match(PromptKeys(list(range(4 * BS + 1))))[0] == 4 * BS
        pub.buffer.clear()  # the restart
        other = [1000 + i for i in range(BS)]
        await pub.publish(batch(stored([b"new"], None, other)), live=False)  # lost
        await pub.publish(chain_batch(len(pub.buffer)))  # seq 1, behind the last
        await _until(lambda: kv.last_seq == 1, task)
        assert kv.complete and kv.errors == 0 and kv.replayed >= 1
        assert kv.match(PromptKeys([*other, 0])) == (BS, True)  # the new history, from its start
        assert kv.match(PromptKeys(list(range(4 * BS + 1)))) == (0, True)  # the old one forgotten

    _run_with(pub, router, body)


def test_without_a_replay_socket_a_late_subscriber_knows_only_what_it_heard():
    pub = Publisher()
    router = _replaying(pub, replay=False)
    kv = router.engines[0].kv

    async def body(task):
        for k in range(3):
            await pub.publish(chain_batch(k), live=False)
        await _publish_until(pub, lambda: kv.batches >= 1, task)

    _run_with(pub, router, body)
    assert not pub.requests and not kv.complete and kv.replayed == 0
    assert kv.unchained >= 1  # its first block's parent was never heard


def test_a_replay_socket_that_does_not_answer_leaves_the_gap_a_gap(monkeypatch):
    """The replay at subscribing times out: the live batches that show a gap are applied
    as a gap (not complete) without asking the silent socket again, which would hold the
    live batches back ``REPLAY_S`` each time."""
    monkeypatch.setattr(loop_module, "REPLAY_S", 0.05)
    pub = Publisher()
    pub.answer = False
    router = _replaying(pub)
    kv = router.engines[0].kv

    async def body(task):
        await _until(lambda: pub.requests, task)
        await pub.publish(chain_batch(0), live=False)
        await _publish_until(pub, lambda: kv.batches >= 3, task)

    _run_with(pub, router, body)
    assert pub.requests == [0]  # at subscribing only: quiet since
    assert not kv.complete and kv.replayed == 0 and kv.batches >= 3


def test_a_replay_that_trickles_is_cut_off_by_its_total_time(monkeypatch):
    """Each answer comes within the wait for the next one, but a replay may not hold
    the live batches back longer than ``REPLAY_TOTAL_S`` in all."""
    monkeypatch.setattr(loop_module, "REPLAY_S", 0.5)
    monkeypatch.setattr(loop_module, "REPLAY_TOTAL_S", 0.2)
    pub = Publisher()
    router = _replaying(pub)
    kv = router.engines[0].kv

    async def serve() -> None:
        client, _, _start = await pub.router.recv_multipart()
        pub.requests.append(0)
        for k in range(1000):
            await pub.router.send_multipart(
                [client, b"", b"kv", k.to_bytes(8, "big"), chain_batch(k)])
            await asyncio.sleep(0.02)

    monkeypatch.setattr(pub, "serve", serve)

    async def body(task):
        await _until(lambda: pub.requests, task)
        await _publish_until(pub, lambda: kv.batches > kv.replayed, task)  # live again

    _run_with(pub, router, body)
    assert 1 <= kv.replayed < 100  # ~10 in 0.2 s, not the thousand


@pytest.mark.parametrize(("answer", "applied"), [
    ([b"", b"kv", (7).to_bytes(8, "big"), b"not msgpack"], 1),  # then out of order
    ([b"", b"kv", b"short"], 0),  # unreadable
])
def test_a_hostile_replay_answer_ends_the_replay(monkeypatch, answer, applied):
    """A replay answer that is not the next batch in order ends the replay (here the same
    one a thousand times: one is applied, or none if it cannot be read); the live
    subscription goes on. (Its first live batches restart the history at 0.)"""
    pub = Publisher()
    router = _replaying(pub)
    kv = router.engines[0].kv

    async def serve() -> None:
        while True:
            client, _, _start = await pub.router.recv_multipart()
            pub.requests.append(0)
            hostile = len(pub.requests) == 1  # later replays (gaps) find nothing buffered
            for _ in range(1000 if hostile else 0):
                await pub.router.send_multipart([client, *answer])
            await pub.router.send_multipart([client, b"", b"", Publisher.END, b""])

    monkeypatch.setattr(pub, "serve", serve)

    async def body(task):
        await _until(lambda: pub.requests, task)
        await _publish_until(pub, lambda: kv.batches > applied, task)

    _run_with(pub, router, body)
    assert kv.replayed == applied and kv.errors >= applied  # the garbage batch: an error


def test_discovered_engines_have_their_kv_sockets_on_their_own_address():
    from narwhal.config import Discovery
    from narwhal.server.discovery import engine_configs
    from narwhal.server.kube_discovery import pod_engines

    d = Discovery("dns", "vllm.svc", port=8000, kv_events_port=5557, kv_replay_port=5600)
    cfgs = {c.name: c for c in engine_configs(d, {"10.0.0.1", "fd00::5"}).values()}
    assert cfgs["vllm.svc/10.0.0.1"].kv_events == "tcp://10.0.0.1:5557"
    assert cfgs["vllm.svc/10.0.0.1"].kv_replay == "tcp://10.0.0.1:5600"
    assert cfgs["vllm.svc/fd00::5"].kv_events == "tcp://[fd00::5]:5557"
    pod = {"metadata": {"name": "p"}, "status": {
        "podIP": "10.0.0.9", "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}]}}
    two = sorted(pod_engines(d, pod, [8000, 8001]).values(), key=lambda c: c.url)
    # Two engines in one Pod: the second's sockets one port up, as vLLM's ranks are.
    assert [(c.kv_events, c.kv_replay) for c in two] == [
        ("tcp://10.0.0.9:5557", "tcp://10.0.0.9:5600"),
        ("tcp://10.0.0.9:5558", "tcp://10.0.0.9:5601")]
    plain = Discovery("dns", "vllm.svc")
    assert all(not c.kv_events and not c.kv_replay
               for c in engine_configs(plain, {"10.0.0.1"}).values())


def test_subscribers_follow_the_pool_as_discovery_changes_it():
    """An engine discovered later gets a subscriber (which replays what its engine
    buffered); one that leaves and drains loses it."""
    from narwhal.config import Discovery
    from narwhal.server.discovery import engine_configs

    pub = Publisher()
    d = Discovery("dns", "engines", port=1, kv_events_port=pub.port,
                  kv_replay_port=pub.replay_port)
    router = Router(parse({"engines": {"discovery": "dns", "name": "engines"}}))
    subscribers = loop_module.KvSubscribers(router)
    router.listeners.append(subscribers.sync)

    async def run() -> None:
        server = asyncio.ensure_future(pub.serve())
        try:
            await pub.publish(chain_batch(0), live=False)
            subscribers.sync()
            assert not subscribers.tasks  # nothing discovered yet
            router.pool.reconcile(engine_configs(d, {"127.0.0.1"}))
            router.changed()
            (e, task), = subscribers.tasks.values()
            await _until(lambda: e.kv.replayed == 1, task)
            assert e.kv.complete and e.kv.match(PromptKeys(list(range(BS + 1)))) == (BS, True)
            router.pool.reconcile({})  # gone from DNS; nothing in flight: dropped
            router.changed()
            assert e not in router.engines and not subscribers.tasks
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert task.cancelled()
        finally:
            server.cancel()
            for task in subscribers.cancel():
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    try:
        asyncio.run(run())
    finally:
        pub.close()


class _Engine:
    """An engine's prefix cache as the truth: blocks stored on a held parent (or at the
    root), evicted, or all lost at a restart; every change published as one batch with
    the next sequence number, and kept in a replay buffer of ``buffer`` batches."""

    def __init__(self, buffer: int) -> None:
        self.seq = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer)
        self.parent: dict[bytes, bytes | None] = {}  # every block of this incarnation
        self.tokens: dict[bytes, list[int]] = {}
        self.held: set[bytes] = set()
        self.made = 0

    def _publish(self, *events) -> tuple[int, bytes]:
        item = (self.seq, batch(*events))
        self.buffer.append(item)
        self.seq += 1
        return item

    def store(self, pick: int) -> tuple[int, bytes]:
        parents = [None, *sorted(self.held)]
        parent = parents[pick % len(parents)]
        h = f"h{self.made}".encode()
        ids = [self.made * BS + i for i in range(BS)]  # no two blocks alike
        self.made += 1
        self.parent[h], self.tokens[h] = parent, ids
        self.held.add(h)
        return self._publish(stored([h], parent, ids))

    def evict(self, pick: int) -> tuple[int, bytes] | None:
        if not self.held:
            return None
        h = sorted(self.held)[pick % len(self.held)]
        self.held.discard(h)
        return self._publish(removed([h]))

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()
        self.parent.clear()
        self.tokens.clear()
        self.held.clear()

    def path(self, h: bytes) -> list[bytes]:
        out: list[bytes] = []
        cur: bytes | None = h
        while cur is not None:
            out.append(cur)
            cur = self.parent[cur]
        return out[::-1]

    def replay(self, r: Replay):
        """What its replay socket answers, in order, as far as ``r`` takes them."""
        for seq, payload in list(self.buffer):
            if seq >= r.start:
                if not r.takes(seq):
                    return
                yield seq, payload


_OPS = st.lists(st.tuples(st.sampled_from(["store", "store", "evict", "restart"]),
                          st.integers(0, 50), st.booleans()), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, late=st.integers(0, 10), buffer=st.sampled_from([3, 1000]),
       table=st.sampled_from([4, 1000]))
def test_the_replayed_history_is_the_engines_whatever_was_lost(ops, late, buffer, table):
    """Live batches lost at random (the flag), engine restarts (seen by the health checks:
    the engine was down), a subscriber that joins after ``late`` changes, a replay
    buffer that may be too short: whenever the latest batch reached the subscriber, what
    it calls complete is exactly what the engine holds, block by block; and with a buffer
    and a table (``prefix_index_blocks``) long enough, it is always complete then."""
    engine = _Engine(buffer)
    router = Router(parse({"engines": [{"name": "a", "url": "http://h:1",
                                        "kv_events": "tcp://h:1", "kv_replay": "tcp://h:2"}],
                           "telemetry": {"profiling": False},
                           "scheduler": {"prefix_index_blocks": table}}))
    e = router.engines[0]
    kv = e.kv
    observe = router.pool.observe_kv_events
    router.pool.observe(e, Scrape(healthy=True), 0.0, 16.0)
    for i, (op, pick, lost) in enumerate(ops):
        if op == "restart":  # down for a health check or more, then back
            engine.restart()
            router.pool.observe(e, Scrape(unreachable=True), 0.0, 16.0)
            router.pool.observe(e, Scrape(healthy=True), 0.0, 16.0)
            continue
        item = engine.store(pick) if op == "store" else engine.evict(pick)
        if i == late:  # subscribes: first the replay, then whatever comes live
            for seq, payload in engine.replay(kv.resume()):
                observe(e, payload, 0.0, seq, True)
        if item is None or i < late or lost:
            continue
        seq, payload = item
        if kv.duplicate(seq):
            continue
        missed = kv.missing(seq)
        if missed is not None:
            for s, p in engine.replay(missed):
                observe(e, p, 0.0, s, True)
        observe(e, payload, 0.0, seq)
        if buffer > len(ops) and table > len(ops):
            assert kv.complete
        if kv.complete:
            for h in engine.parent:
                path = engine.path(h)
                ids = [t for b in path for t in engine.tokens[b]]
                held = next((n for n, b in enumerate(path) if b not in engine.held), len(path))
                assert kv.match(PromptKeys([*ids, 0])) == (held * BS, True), (h, path)
