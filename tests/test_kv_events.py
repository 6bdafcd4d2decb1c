"""Engines' KV-cache events: the wire format, the reported blocks, and their use in
projections, on a fake clock. The wire bytes are built the way vLLM's publisher builds
them (msgspec msgpack of ``[ts, [tagged events], dp_rank]``); the real-vLLM tier checks
the same path against vLLM itself."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.config import parse
from narwhal.core.chat_prompt import PromptIds
from narwhal.core.kv_events import KvBlocks, KvEventError, chain, decode_batch
from narwhal.core.placement import project
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
    assert kv.match(prompt)[0] == 12 and kv.block_size == BS
    assert kv.match([1, 2, 3, 4, 0, 0, 0, 0, 9])[0] == 4  # one different block ends it
    assert kv.match([9, 10, 11, 12, 1])[0] == 0  # a block is its whole prefix, not its tokens


def test_the_last_prompt_token_is_never_a_hit():
    kv = KvBlocks(100)
    kv.apply(decode_batch(batch(stored([b"a", b"b"], None, list(range(8))))), 1.0)
    assert kv.match(list(range(8)))[0] == 4  # the engine computes the last token itself
    assert kv.match(list(range(9)))[0] == 8


def test_removed_and_cleared_forget_blocks():
    kv = KvBlocks(100)
    kv.apply(decode_batch(batch(stored([b"a", b"b"], None, list(range(8))))), 1.0)
    kv.apply(decode_batch(batch(removed([b"b"]))), 2.0)
    assert kv.match(list(range(9))) == (4, True)  # known: the engine evicted block 2
    kv.apply(decode_batch(batch({"type": "AllBlocksCleared"})), 3.0)
    assert kv.match(list(range(9)))[0] == 0 and not kv.by_engine and not kv.held


def test_a_history_seen_from_the_engines_start_is_complete_and_a_gap_ends_that():
    kv = KvBlocks(100)
    kv.sequence(0)  # the engine's first batch: everything it holds, Narwhal saw stored
    kv.apply(decode_batch(batch(stored([b"a"], None, [1, 2, 3, 4]))), 1.0)
    assert kv.complete and kv.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == (4, True)
    kv.sequence(1)
    kv.sequence(3)  # batch 2 was lost: it may have evicted anything
    assert not kv.complete and not kv.held and kv.errors == 1
    kv.apply(decode_batch(batch(stored([b"a"], None, [1, 2, 3, 4]))), 2.0)
    assert kv.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == (4, False)  # block 2: unknown now
    kv.sequence(0)  # the engine restarted: its cache is empty, its history complete again
    assert kv.complete and not kv.held


def test_listening_from_the_middle_leaves_unseen_blocks_unknown():
    kv = KvBlocks(100)
    kv.sequence(41)
    kv.apply(decode_batch(batch(stored([b"a"], None, [1, 2, 3, 4]))), 1.0)
    assert not kv.complete and kv.match([5, 6, 7, 8, 9]) == (0, False)


def test_a_block_whose_parent_was_never_seen_is_not_indexed():
    kv = KvBlocks(100)
    kv.apply(decode_batch(batch(stored([b"c"], b"unknown", [1, 2, 3, 4]))), 1.0)
    assert kv.unchained == 1 and not kv.by_engine


def test_the_table_is_bounded():
    kv = KvBlocks(3)
    ids = list(range(40))
    kv.apply(decode_batch(batch(stored([bytes([i]) for i in range(10)], None, ids))), 1.0)
    assert len(kv.by_engine) == 3 and len(kv.held) == 3


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
])
def test_malformed_batches_are_refused(payload, message):
    with pytest.raises(KvEventError, match=message):
        decode_batch(payload)


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


def router_with_events(clock) -> Router:
    r = Router(parse({"engines": [
        {"name": "a", "url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:5557"}]}),
        clock=clock)
    for e in r.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = clock()
    r.started = True
    return r


def test_projection_counts_only_the_reported_uncached_prompt_and_falls_back_when_stale():
    now = [100.0]
    router = router_with_events(lambda: now[0])
    e = router.engines[0]
    assert e.kv is not None
    router.pool.observe_kv_events(e, batch(stored([b"a", b"b"], None, list(range(8)))), now[0])
    t = Ticket(object(), 10, now[0], 1.0, now[0] + 60)
    t.prompt_ids = list(range(10))
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


def test_chain_is_over_whole_blocks_only():
    assert len(chain(list(range(11)), 4)) == 2
    assert chain([1, 2, 3, 4], 4) != chain([1, 2, 3, 4], 2)[:1]


class Tok:
    """A stand-in tokenizer: one ID per character (the template is under test here)."""

    class Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text, add_special_tokens=False):
        return self.Enc([ord(c) for c in text])


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
    t.prompt_ids = list(range(100))  # not among the reported blocks
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
    t.prompt_ids = list(range(100))
    assert project(e, t, now=now[0]).work == pytest.approx(100.0)  # known: nothing cached
    e.kv.dispatched(now[0])
    now[0] += 6.0  # events overdue: neither the reported blocks nor an index can say
    c = project(e, t, now=now[0])
    assert c.cached == 0.0 and c.work == pytest.approx(50.0)


def test_a_subscriber_that_fails_subscribes_again(monkeypatch):
    """An unforeseen failure while reading (here injected once into the pool) must not
    end the engine's events: the loop subscribes again and reads the next batches."""
    monkeypatch.setattr(loop_module, "RESUBSCRIBE_S", (0.01, 0.01))
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = Router(parse({"engines": [
        {"name": "a", "url": "http://127.0.0.1:1", "kv_events": f"tcp://127.0.0.1:{port}"}]}))
    e = router.engines[0]
    real = router.pool.observe_kv_events
    failures = []

    def fail_once(*args, **kw):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected")
        real(*args, **kw)

    monkeypatch.setattr(router.pool, "observe_kv_events", fail_once)

    async def run() -> None:
        task = asyncio.ensure_future(loop_module.kv_events_loop(router, e))
        seq = 0
        while e.kv.batches == 0:  # a PUB socket drops what no subscriber holds yet
            assert not task.done()
            await pub.send_multipart([b"", seq.to_bytes(8, "big"),
                                      batch(stored([b"a"], None, list(range(BS))))])
            seq += 1
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(run())
    finally:
        pub.close(linger=0)
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
