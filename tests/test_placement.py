"""The placement pipeline, TPOT scoring and output-length learning on a fake clock."""

from __future__ import annotations

import orjson
import pytest

from narwhal.config import ConfigError, parse
from narwhal.core.outputs import OutputLengths, system_hash
from narwhal.core.placement import project
from narwhal.core.router import Router
from narwhal.core.scheduler import Dispatch, Queued, Refuse, Ticket


def router(**sections) -> Router:
    cfg = {"engines": [{"name": "fast", "url": "http://127.0.0.1:1", "prefill_tps": 4000,
                        "tpot_ms": 40},
                       {"name": "slow", "url": "http://127.0.0.1:2", "prefill_tps": 1000,
                        "tpot_ms": 10}]}
    cfg.update(sections)
    r = Router(parse(cfg), clock=lambda: 100.0)
    r.started = True
    for e in r.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = 100.0
    return r


def ticket(tokens: int = 1000, tpot_s: float | None = None) -> Ticket:
    return Ticket(None, tokens, 100.0, 60.0, 160.0, tpot_budget_s=tpot_s)


def annotate(r: Router, t: Ticket, body: dict, max_tokens: int) -> None:
    """A chat request's ticket annotated as admission does, its prompt measured here."""
    r.scheduler.annotate(t, True, body, max_tokens, r.scheduler.prompt_facts(True, body))


def chat_ticket(r: Router, system: dict, question: str, tokens: int) -> Ticket:
    """A sized chat request with a system prompt, annotated for the prefix index."""
    t = ticket(tokens)
    annotate(r, t, {"messages": [system, {"role": "user", "content": question}]}, 64)
    return t


def test_the_default_profile_picks_the_shortest_projected_ttft():
    r = router()
    d = r.scheduler.admit(ticket(), 100.0)
    assert isinstance(d, Dispatch) and d.engine.name == "fast"


def test_a_tpot_budget_filters_engines_and_refuses_when_none_meets_it():
    r = router()
    d = r.scheduler.admit(ticket(tpot_s=0.02), 100.0)  # fast decodes at 40 ms a token
    assert isinstance(d, Dispatch) and d.engine.name == "slow"
    d = r.scheduler.admit(ticket(tpot_s=0.005), 100.0)
    assert isinstance(d, Refuse) and d.error.status == 429
    assert d.error.code == "tpot_budget_exceeded" and d.error.terminal == "refused"


def test_scorers_are_weighted_and_named_in_config():
    r = router(scheduler={"scorers": {"ttft": 0.1, "kv-cache": 1.0}})
    fast, slow = r.engines
    fast.kv_cache_usage, slow.kv_cache_usage = 0.9, 0.1
    d = r.scheduler.admit(ticket(), 100.0)
    assert d.engine is slow  # kv headroom outweighs the faster prefill


def test_an_engine_is_loaded_past_its_verified_backlog_only_when_every_engine_is():
    # fast has had first tokens measured behind up to 1400 tokens of prefill, slow behind
    # 20000: a third 1000-token request would put 3000 on fast, past 1.5 times what was
    # ever checked there (2100), so it goes to slow.
    r = router(admission={"mode": "predictive", "ttft_target_ms": 60000})
    s = r.scheduler
    fast, slow = r.engines
    fast.verified_work, slow.verified_work = 1400, 20000
    assert [s.admit(ticket(), 100.0).engine.name for _ in range(3)] == ["fast", "fast", "slow"]
    # admission judges the engines the request may go to: slow's 2 s, not fast's 0.75 s
    d = s.admit(Ticket(None, 1000, 100.0, 1.5, 160.0), 100.0)
    assert isinstance(d, Refuse) and d.error.status == 429
    # nothing within its verified backlog anywhere: every engine, as without the filter
    slow.verified_work = 0
    assert s.admit(ticket(), 100.0).engine is fast
    # and without the filter configured, fast takes them all
    plain = router(scheduler={"filters": ["subset", "has-slot"]})
    plain.engines[0].verified_work = 1400
    assert [plain.scheduler.admit(ticket(), 100.0).engine.name for _ in range(3)] == [
        "fast"] * 3


def test_a_first_token_verifies_the_backlog_it_was_dispatched_behind():
    r = router()
    s = r.scheduler
    fast, _ = r.engines
    t1, t2 = ticket(), ticket()
    s.admit(t1, 100.0)
    s.admit(t2, 100.0)
    assert t2.engine is fast and t2.work_ahead == 2000
    s.first_token(t2, 100.8)
    assert fast.verified_work == 2000


def test_decode_load_scorer_uses_predicted_output():
    r = router(scheduler={"scorers": {"decode-load": 1.0}})
    fast, slow = r.engines
    fast.decode_backlog, slow.decode_backlog = 5000, 100
    assert r.scheduler.admit(ticket(), 100.0).engine is slow


@pytest.mark.parametrize("section, message", [
    ({"filters": ["subset", "nope"]}, "scheduler.filters: unknown 'nope'"),
    ({"scorers": {"ttft": 1, "magic": 2}}, "scheduler.scorers: unknown 'magic'"),
    ({"picker": "random"}, "scheduler.picker: unknown 'random'"),
    ({"scorers": {}}, "at least one scorer"),
    ({"scorers": {"ttft": -1}}, "must not be negative"),
    ({"filters": "has-slot"}, "expected a list of names"),
])
def test_unknown_plugins_are_config_errors(section, message):
    with pytest.raises(ConfigError, match=message):
        parse({"scheduler": section})


def test_passthrough_uses_the_pipeline():
    r = router()
    fast, slow = r.engines
    fast.prefill_work = 100_000  # 25 s of prefill queued on fast
    assert r.scheduler.place_passthrough(100.0, None) == [slow, fast]  # chosen, fallback
    assert r.scheduler.place_passthrough(100.0, frozenset({fast.endpoint})) == [fast]


def test_output_lengths_learn_per_application_and_back_off():
    o = OutputLengths(default=128)
    chat_a = {"messages": [{"role": "system", "content": "You write haiku."}]}
    chat_b = {"messages": [{"role": "system", "content": "You write essays."}]}
    ka = o.keys(True, system_hash(chat_a), 1024, 300)
    kb = o.keys(True, system_hash(chat_b), 1024, 300)
    assert o.predict(ka, 1024) == 128
    for _ in range(30):
        o.learn(ka, o.predict(ka, 1024), 20)
        o.learn(kb, o.predict(kb, 1024), 600)
    assert o.predict(ka, 1024) == pytest.approx(20, abs=2)
    assert o.predict(kb, 1024) == pytest.approx(600, abs=30)
    assert o.predict(kb, 100) == 100  # never above max_tokens
    other_size = o.keys(True, system_hash(chat_a), 1024, 5000)  # unseen prompt size
    assert o.predict(other_size, 1024) == pytest.approx(20, abs=2)  # backs off to the app
    summary = o.error_summary()
    assert summary["samples"] == 60 and summary["p50"] < 0.2


def test_output_length_memory_is_bounded():
    o = OutputLengths()
    for i in range(10_000):
        o.learn(o.keys(True, i, 64, 10), 10, 10)
    assert len(o.stats) <= 4096


def test_completion_feeds_output_learning_through_release():
    r = router()
    t = ticket()
    annotate(r, t, {"messages": []}, 256)
    assert t.predicted_output == 128
    d = r.scheduler.admit(t, 100.0)
    assert d.engine.decode_backlog == 128
    r.scheduler.first_token(t, 100.5)
    r.scheduler.release(t, 40)
    assert d.engine.decode_backlog == 0
    assert r.learning.outputs.error_summary()["samples"] == 1


def test_prefix_index_charges_only_uncached_prefill_and_steers_placement():
    r = router(engines=[{"name": "a", "url": "http://127.0.0.1:1", "prefill_tps": 2000},
                        {"name": "b", "url": "http://127.0.0.1:2", "prefill_tps": 2000}])
    a, b = r.engines
    system = {"role": "system", "content": "You are a careful assistant. " * 100}  # 2.9 kB

    def t_for(question: str) -> Ticket:
        return chat_ticket(r, system, question, 750)

    first = t_for("first?")
    assert r.scheduler.admit(first, 100.0).engine is a  # tie: the first listed
    r.scheduler.first_token(first, 100.4)
    r.scheduler.release(first, 10)
    b.prefill_work = 300  # b is a little busier, and has not seen the system prompt
    second = t_for("second?")
    d = r.scheduler.admit(second, 100.5)
    assert d.engine is a and second.work < 0.1 * 750  # ~95% of the prompt is cached on a
    assert a.prefix.match(second.blocks) == len(second.blocks)
    assert a.predicted_hit_rate > 0
    # Cumulative tokens and expected-cached tokens: comparable with the engine's counters.
    assert a.index_tokens == 1500 and 700 < a.index_cached_tokens < 750


def test_a_completed_reply_joins_the_index_where_it_was_generated():
    # Engines cache a reply's blocks too (vLLM v1 hashes output tokens): the next turn of
    # the conversation, which carries the reply, is charged only for what follows it.
    r = router(engines=[{"name": "a", "url": "http://127.0.0.1:1", "prefill_tps": 2000},
                        {"name": "b", "url": "http://127.0.0.1:2", "prefill_tps": 2000}])
    a, b = r.engines
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    user = {"role": "user", "content": "Tell me about narwhals. " * 10}
    reply = "Narwhals are arctic whales with a long tusk. " * 40  # 1.8 kB: 28 blocks
    first = ticket(1000)
    annotate(r, first, {"messages": [system, user]}, 64)
    assert r.scheduler.admit(first, 100.0).engine is a
    r.scheduler.first_token(first, 100.4)
    r.scheduler.release(first, 400, 101.0, reply)
    follow = {"messages": [system, user, {"role": "assistant", "content": reply},
                           {"role": "user", "content": "And their tusks?"}]}
    second = ticket(1000)
    annotate(r, second, follow, 64)
    # All of it but the block the new question falls in.
    assert a.prefix.match(second.blocks) >= len(second.blocks) - 1
    assert b.prefix.match(second.blocks) == 0
    assert project(a, second).cached > 0.9 and project(b, second).cached == 0
    # Not completed (cancelled, failed, refused by the engine): no reply is added.
    third, other = ticket(1000), ticket(1000)
    annotate(r, third, {"messages": [system, {"role": "user", "content": "x"}]}, 64)
    assert r.scheduler.admit(third, 100.0).engine is a
    r.scheduler.release(third, None, 0.0, None)
    annotate(r, other, {"messages": [system, {"role": "user", "content": "x"},
                                                    {"role": "assistant", "content": reply}]}, 64)
    assert a.prefix.match(other.blocks) < len(other.blocks) // 2


def test_a_completions_reply_continues_its_prompt_and_token_blocks_continue_too(tmp_path):
    from narwhal.core.prefix import prompt_blocks, reply_blocks

    prompt = "Once upon a time " * 20
    out = " there lived a narwhal" * 30
    blocks, _, _, chain = prompt_blocks({"prompt": prompt})
    assert chain is not None and not chain.chat
    extended = blocks + reply_blocks(chain, out)
    assert prompt_blocks({"prompt": prompt + out + " more"})[0][:len(extended)] == extended
    # A chat reply is the assistant turn as the canonical prompt renders it.
    messages = [{"role": "user", "content": prompt}]
    blocks, _, _, chain = prompt_blocks({"messages": messages})
    assert chain is not None and chain.chat
    follow = prompt_blocks({"messages": [*messages, {"role": "assistant", "content": out},
                                         {"role": "user", "content": "go on"}]})[0]
    extended = blocks + reply_blocks(chain, out)
    assert follow[:len(extended)] == extended and len(extended) > len(blocks) + 5
    # In tokens (``sizing.tokenizer``): the same, cut in 16-token blocks.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([prompt + out + " user assistant more go on"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    blocks, _, size, chain = prompt_blocks({"messages": messages}, tok)
    assert size == 16 and chain is not None and isinstance(chain.tail, tuple)
    follow = prompt_blocks({"messages": [*messages, {"role": "assistant", "content": out},
                                         {"role": "user", "content": "go on"}]}, tok)[0]
    extended = blocks + reply_blocks(chain, out, tok)
    assert follow[:len(extended)] == extended and len(extended) > len(blocks) + 5


def test_reply_text_takes_the_first_choices_text_and_is_bounded():
    from narwhal.core.prefix import REPLY_MAX_BYTES, ReplyText

    chat = ReplyText(True)
    for event in ({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"delta": {"content": "Hello"}}]},
                  {"choices": [{"delta": {"reasoning_content": "hmm"}}]},
                  {"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]},
                  {"choices": [{"delta": {"content": None}}]},
                  {"choices": [{"delta": "not an object"}]},
                  {"choices": ["not an object"]},
                  {"choices": []},
                  {"choices": [{"delta": {"content": " world"}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"completion_tokens": 2}}):
        chat.event(event)
    assert chat.text() == "Hello world"
    text = ReplyText(False)
    text.event({"choices": [{"text": "a", "index": 0}]})
    text.event({"choices": [{"text": 7}]})
    assert text.text() == "a"
    big = ReplyText(True)
    for _ in range(3 * REPLY_MAX_BYTES // 1000):
        big.event({"choices": [{"delta": {"content": "x" * 1000}}]})
    assert len(big.text()) == REPLY_MAX_BYTES and big.size < REPLY_MAX_BYTES + 1000


@pytest.mark.parametrize("piece", ["a", " the", "\u00e9t\u00e9", "\U0001f600"])
def test_reply_text_holds_and_counts_about_its_bytes(piece):
    """A reply of one-token pieces held a Python string per token, 30-60x its characters
    (4.2 MiB for 64 Ki one-character tokens, measured), and counted nowhere. Joined into
    blocks, it holds at most twice its text; ``held``, which the exchange counts against
    serving.max_held_bytes, is what it holds."""
    import tracemalloc

    from narwhal.core.prefix import REPLY_MAX_BYTES, ReplyText

    events = [orjson.dumps({"choices": [{"delta": {"content": piece}}]})
              for _ in range(2 * REPLY_MAX_BYTES // len(piece))]
    tracemalloc.start()
    reply = ReplyText(True)
    for raw in events:
        reply.event(orjson.loads(raw))
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    chars = len(reply.text())
    assert chars == REPLY_MAX_BYTES
    top = ord(max(piece))
    width = 4 if top > 0xFFFF else 2 if top > 0xFF else 1  # CPython's bytes a character
    assert held < 2 * chars * width + 16_384, held / chars  # 64 one-character pieces a block
    assert 0.8 * held < reply.held < 1.25 * held, (reply.held, held)


def test_prefix_index_memory_is_bounded_and_lru():
    from narwhal.core.prefix import PrefixIndex, prompt_blocks

    idx = PrefixIndex(100)
    old = prompt_blocks({"prompt": "x" * 64 * 60})[0]
    new = prompt_blocks({"prompt": "y" * 64 * 60})[0]
    idx.insert(old)
    idx.insert(new)
    assert len(idx.blocks) == 100 and idx.evictions == 20
    assert idx.match(new) == 60 and idx.match(old) == 0  # the oldest blocks went first
    changed = prompt_blocks({"prompt": "y" * 64 * 10 + "z" + "y" * (64 * 50 - 1)})[0]
    assert idx.match(changed) == 10  # chained: one byte ends the match


def test_kv_full_engines_take_no_new_requests_and_a_full_pool_refuses():
    r = router()
    fast, slow = r.engines
    fast.kv_cache_usage = 0.97
    assert r.scheduler.admit(ticket(), 100.0).engine is slow
    slow.kv_cache_usage = 0.99
    d = r.scheduler.admit(ticket(), 100.0)
    assert isinstance(d, Refuse) and d.error.code == "engines_saturated"
    assert d.error.status == 429 and d.error.retry_after == 1


def test_prefix_affinity_scorer_is_gated_by_load():
    # Affinity only: a 2x busier engine with the prompt cached earns nothing for it.
    r = router(engines=[{"name": "a", "url": "http://127.0.0.1:1", "prefill_tps": 2000},
                        {"name": "b", "url": "http://127.0.0.1:2", "prefill_tps": 2000}],
               scheduler={"scorers": {"prefix-affinity": 1.0, "decode-load": 0.1}})
    a, b = r.engines
    system = {"role": "system", "content": "You are a careful assistant. " * 100}

    def t_for(question: str) -> Ticket:
        return chat_ticket(r, system, question, 750)

    a.prefix.insert(t_for("warm").blocks)
    b.decode_backlog = 10  # without affinity, decode-load would choose a
    a.decode_backlog = 1000
    assert r.scheduler.admit(t_for("q1"), 100.0).engine is a  # cached, and not much slower
    a.prefill_work = 20_000  # 10 s of prefill ahead on a: far more than 1.5x b's
    assert r.scheduler.admit(t_for("q2"), 100.0).engine is b


def test_with_a_tokenizer_the_prefix_index_cuts_token_blocks(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = "narwhal tusk ocean arctic ice whale pod swim deep cold water light".split()
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(
        special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    r = router(sizing={"tokenizer": str(path)},
               engines=[{"name": "a", "url": "http://127.0.0.1:1", "prefill_tps": 2000},
                        {"name": "b", "url": "http://127.0.0.1:2", "prefill_tps": 2000}])
    a = r.engines[0]
    system = {"role": "system", "content": " ".join(words * 10)}  # 120 words: 7 token blocks

    def t_for(question: str) -> Ticket:
        return chat_ticket(r, system, question, 200)

    first = t_for("ice")
    assert first.block_units == 16 and len(first.blocks) == first.prompt_units // 16
    assert r.scheduler.admit(first, 100.0).engine is a
    second = t_for("whale pod")
    # The shared system prompt's token blocks are found; "ice" vs "whale pod" ends it.
    assert a.prefix.match(second.blocks) >= 7
    assert 0.8 < project(a, second).cached <= 1.0
    assert r.sizer.tokens_per_block() == 16.0


def test_prefix_index_memory_stays_bounded_over_a_million_distinct_prefixes():
    """A soak of distinct prompts (every one new): the index's table stops growing at its
    bound and the process does not keep growing either."""
    import resource
    import sys

    from narwhal.core.prefix import PrefixIndex

    idx = PrefixIndex(65536)

    def feed(start: int, n: int) -> None:
        for i in range(start, start + n):
            h = hash(("prompt", i))
            idx.insert([h, hash((h, 1)), hash((h, 2)), hash((h, 3))])

    feed(0, 100_000)
    table = sys.getsizeof(idx.blocks)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the peak so far
    feed(100_000, 900_000)
    assert len(idx.blocks) == 65536 and idx.evictions == 4_000_000 - 65536
    assert sys.getsizeof(idx.blocks) == table
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 32 * 1024


def test_predictive_admission_holds_a_request_every_engine_would_take_past_its_evidence():
    """Regression (scheduling benchmark, 1.5x): with the fastest engine at its sequence
    cap, the next was the only candidate, and the filter (which never refuses) handed it
    twice the backlog it had been measured behind; projected at half the budget, those
    requests took twice that. Now they wait in the queue until a first token drains or
    verifies a backlog. An idle engine always takes a request."""
    r = router(admission={"mode": "predictive", "ttft_target_ms": 60000})
    s = r.scheduler
    fast, slow = r.engines
    fast.verified_work = slow.verified_work = 1400  # each takes two 1000-token prefills
    placed = [ticket() for _ in range(4)]
    assert [s.admit(t, 100.0).engine.name for t in placed] == ["fast", "fast", "slow", "slow"]
    held = ticket()
    assert isinstance(s.admit(held, 100.0), Queued) and held.engine is None
    assert s.pump(100.1) == []  # nothing changed
    s.first_token(placed[0], 100.5)  # fast: 1000 ahead now, 2000 within 1.5 x 1400
    assert s.pump(100.5) == [held] and held.engine is fast
    # open admission places it (the promise it keeps is the queue's, not the budget's)
    plain = router(admission={"mode": "open"})
    for e in plain.engines:
        e.verified_work = 1000
    assert all(isinstance(plain.scheduler.admit(ticket(), 100.0), Dispatch)
               for _ in range(5))


def test_with_prefills_waiting_the_promise_is_at_least_one_step_over_the_projection():
    """Regression (scheduling benchmark, 1.5x): an l4 whose loaded step was ~0.65 of the
    1 s budget took a burst of eight requests projected at ~0.7 s (its fit is linear in
    the work ahead and had never seen two steps) and served them in ~1.35 s. A request
    that arrives as a step begins waits it out: with a backlog on the engine, what is
    promised is at least the projection plus one step."""
    from narwhal.core.placement import Candidate

    r = router(admission={"mode": "predictive"})
    fast = r.engines[0]
    for k in range(1, 5):  # first tokens 0.65 s apart, each request waiting across one
        fast.model.observe_first_token(100.0 + 0.65 * k, dispatched_at=100.0 + 0.65 * k - 1)
    assert fast.model.step_s == pytest.approx(0.65)
    idle = Candidate(fast, 0.3, 0.02, 300, 0.0)
    assert idle.ttft_margin_s == pytest.approx(0.3)  # nothing ahead: the step in flight is short
    fast.prefill = 3
    busy = Candidate(fast, 0.3, 0.02, 300, 0.0)
    assert busy.ttft_margin_s == pytest.approx(0.95)
    r.engines[1].healthy = False  # fast alone, projected well within 0.6 s...
    t = Ticket(None, 300, 100.0, 0.6, 160.0)
    assert project(fast, t).ttft_s < 0.3
    d = r.scheduler.admit(t, 100.0)  # ...but a step more is past it
    assert isinstance(d, Refuse) and d.error.code == "ttft_budget_exceeded"
    fast.prefill = 0  # nothing waiting there: the projection is the promise
    assert isinstance(r.scheduler.admit(Ticket(None, 300, 100.0, 0.6, 160.0), 100.0), Dispatch)
