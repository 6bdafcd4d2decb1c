"""Profiling on a fake clock: probes, token-ID validation, backoff, re-profiling."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import orjson
import pytest
from aiohttp import web

from narwhal.config import parse
from narwhal.core.meter import EngineOutputError
from narwhal.core.profiling import BACKOFF_S, PROBE_PROMPTS, ProbeRun, Profiler
from narwhal.core.router import Router
from narwhal.core.scheduler import Ticket
from narwhal.core.tokens import TokenIdError
from narwhal.launch import free_port
from narwhal.server.profiling import _max_model_len


def event(ids: object, text: str = " x") -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": text},
                                                  "token_ids": ids}]}) + b"\n\n"


ROLE = b"data: " + orjson.dumps({"prompt_token_ids": list(range(40)), "choices": [
    {"index": 0, "delta": {"role": "assistant", "content": ""}}]}) + b"\n\n"


def run_of(chunks: list[tuple[float, bytes]]) -> ProbeRun:
    run = ProbeRun(10.0, token_ids=True, max_event_bytes=65536)
    for at, chunk in chunks:
        run.feed(at, chunk)
    return run


def test_a_probe_measures_ttft_intervals_and_the_engine_prompt_size():
    run = run_of([(10.0, ROLE), (10.5, event([5])), (10.52, event([6, 7])),
                  (10.56, event([8]) + b"data: [DONE]\n\n")])
    m = run.finish(estimated_prompt=64)
    assert m.ttft_s == pytest.approx(0.5)
    assert m.intervals == pytest.approx([0.01, 0.04])
    assert m.prompt_tokens == 40  # the engine's count, not the estimate


@pytest.mark.parametrize("ids, error", [(None, "without token_ids"), ([True], "Boolean"),
                                        ("7", "malformed"), ([-1], "invalid")])
def test_a_probe_fails_on_bad_token_ids(ids, error):
    with pytest.raises(TokenIdError, match=error):
        run_of([(10.0, ROLE), (10.5, event(ids))])


def test_a_probe_without_output_or_end_fails():
    with pytest.raises(EngineOutputError):
        run_of([(10.0, ROLE + b"data: [DONE]\n\n")]).finish(64)
    with pytest.raises(EngineOutputError):
        run_of([(10.0, ROLE), (10.5, event([5]))]).finish(64)  # no [DONE]


def test_probes_are_sized_and_share_no_prefix():
    p = Profiler("m", 4.0, 30, random.Random(1))
    probes = p.probes()
    assert [x.tokens for x in probes] == list(PROBE_PROMPTS)
    bodies = [orjson.loads(x.body) for x in probes]
    texts = [b["messages"][0]["content"] for b in bodies]
    assert len({t[:16] for t in texts}) == len(PROBE_PROMPTS)
    for tokens, t in zip(PROBE_PROMPTS, texts, strict=True):
        assert tokens * 4 <= len(t) < tokens * 4 + 20
    assert all(b["return_token_ids"] and b["stream"] for b in bodies)


def _router(engines: int = 1) -> Router:
    r = Router(parse({"engines": [{"name": f"e{i}" if i else "e", "url": f"http://127.0.0.1:{i + 1}"}
                                  for i in range(engines)]}), clock=lambda: 100.0)
    for e in r.engines:
        e.healthy = e.checked = True
        e.telemetry_at = 100.0
    r.started = True
    return r


def test_an_engine_is_eligible_only_once_profiled_and_failures_back_off():
    r = _router()
    e = r.engines[0]
    p = Profiler("m", 4.0, 30)
    assert not e.profiled and r.pool.serviceable(100.0) == []
    assert r.not_ready_reason() == "profiling"
    assert p.due(r.engines, 100.0) == [e] and p.due(r.engines, 100.0) == []  # running
    p.failed(e, "engine event has a Boolean token ID", 100.0)
    assert not e.profiled and e.profile_error.endswith("Boolean token ID")
    assert p.due(r.engines, 100.0 + BACKOFF_S[0] - 0.01) == []
    assert p.due(r.engines, 100.0 + BACKOFF_S[0]) == [e]
    p.failed(e, "again", 101.0)
    assert e.profile_next_at == 101.0 + BACKOFF_S[1]
    assert p.due(r.engines, 200.0) == [e]
    p.succeeded(e, 200.0)
    assert e.profiled and e.profile_error is None and e.profile_attempts == 0
    assert r.pool.serviceable(100.0) == [e] and r.not_ready_reason() is None


def test_profile_measurements_feed_the_model():
    r = _router()
    e = r.engines[0]
    before = e.model.ttft_s(1000, 0)
    for tokens, seconds in ((64, 0.08), (512, 0.2), (1536, 0.5)):
        run = run_of([(10.0, ROLE.replace(b"range", b"range")),
                      (10.0 + seconds, event([1])), (10.0 + seconds + 0.02, event([2])),
                      (10.0 + seconds + 0.04, event([3]) + b"data: [DONE]\n\n")])
        m = run.finish(tokens)
        m.prompt_tokens = tokens
        r.learning.probe(e, m, 0.0, 0)
    assert e.model.samples == 3
    assert e.model.ttft_s(1000, 0) > before * 2  # the default seeds were optimistic
    assert e.model.tpot_s(1) == pytest.approx(0.02, rel=0.2)


def test_a_profile_whose_tokens_arrive_in_bursts_still_projects_their_pace():
    """Two events read together make a gap of ~0 s between them; a per-gap sample of it
    outweighed the rest in the relative fit and projected a 5 ms engine at under 1 ms."""
    r = _router()
    e = r.engines[0]
    for _ in range(3):
        run = run_of([(10.0, ROLE), (10.1, event([1])), (10.15, event([2])),
                      (10.15001, event([3])), (10.2, event([4]) + b"data: [DONE]\n\n")])
        r.learning.probe(e, run.finish(64), 0.0, 0)
    assert e.model.tpot_s(1) == pytest.approx(0.1 / 3, rel=0.3)


def test_before_any_live_step_the_promise_takes_the_longest_probe_as_the_step():
    """Regression (tenants benchmark, cold pool at 1.0x): an l4 that had just joined took
    long cold prompts under load before any request had waited across one of its steps;
    with no step known, the promise was the bare projection, and 9 of its requests
    projected at 0.62-0.85 s were measured at 1.0-1.5 s."""
    from narwhal.core.placement import Candidate
    from narwhal.core.profiling import Measurement

    r = _router()
    e = r.engines[0]
    assert e.model.step_s == 0.0
    r.learning.profile(e, [(Measurement(n, ttft), 0.0, 0) for n, ttft in
                           ((64, 0.08), (256, 0.17), (1536, 0.47), (1024, 0.3), (512, 0.21))])
    assert e.model.step_s == pytest.approx(0.47) and e.model.live_steps == 0
    e.prefill = 2  # prefills waiting there: the promise is at least a step more
    assert Candidate(e, 0.3, 0.02, 300, 0.0).ttft_margin_s >= 0.77
    r.learning.profile(e, [(Measurement(64, 0.04), 0.0, 0),
                           (Measurement(1536, 0.07), 0.0, 0)])  # a re-profile, faster
    assert e.model.step_s == pytest.approx(0.07)  # the latest profile's, not the old one's
    e.model.observe_first_token(10.0, dispatched_at=9.0)
    e.model.observe_first_token(10.6, dispatched_at=9.8)  # a live step takes over
    assert e.model.step_s == pytest.approx(0.6) and e.model.live_steps == 1


@pytest.mark.parametrize("engines", [1, 2])
def test_a_drifted_engine_is_profiled_again_before_new_work(engines):
    r = _router(engines)
    for other in r.engines:
        other.profiled = True
    e = r.engines[0]
    clock = 100.0

    def one(work: float, seconds: float) -> None:
        t = Ticket(owner=None, tokens=int(work), arrival=clock, budget_s=60,
                   deadline=clock + 60)
        e.prefill += 1
        t.engine, t.dispatched_at, t.work, t.work_ahead = e, clock, work, work
        t.predicted_ttft_s = 0.05 + work / 2000  # projected as the engine was at first
        e.prefill_work += work
        r.scheduler.first_token(t, clock + seconds)

    for i in range(60):
        work = 200.0 + 100 * (i % 10)
        one(work, 0.05 + work / 2000)  # learned: 2000 tokens/s
    assert e.profiled and e.model.drift_resets == 0
    for i in range(20):
        work = 200.0 + 100 * (i % 10)
        one(work, 2 * (0.05 + work / 2000))  # the engine halves its speed
        if e.model.drift_resets:
            break
    assert e.model.drift_resets == 1 and i < 12, i
    # measured again, unless it is the only engine that can serve (no outage for drift)
    assert e.profiled is (engines == 1)
    # and, measured again, it takes work from what its new profile verifies: the backlog
    # its old model had verified is history (kept without a profile: nothing replaces it)
    assert e.verified_work == (1100.0 if engines == 1 else 0.0)
    # Its admission margins measured the old model: forgotten with it when it is
    # profiled again (the pool's margin stands in until its own return); kept by the
    # only engine, whose reopened model relearns from live traffic meanwhile.
    if engines == 1:
        assert e.calibration.factor(0.5) > 1.5  # the drift's ratios (~2x)
    else:
        assert e.calibration.octaves() == []
        assert e.calibration.factor(0.5) == r.pool.calibration.factor(0.5) > 1.5


def test_profile_probes_count_as_uncached_prompts_sent_to_the_engine():
    """The engine's prefix-cache counters count the probes' prompts (never cached: a
    fresh nonce first), so the predicted hit rate must count them too, or an engine
    profiled within a window reads as over-predicted by the probes' share."""
    from narwhal.core.profiling import Measurement

    r = _router()
    e = r.engines[0]
    assert e.prefix.capacity > 0
    r.learning.probe(e, Measurement(1000, 0.1), 0.0, 0)
    e.prompt_sent(1000, 0.8)  # then a request placed with 80% of its prompt indexed
    # the engine saw 2000 prompt tokens and 800 hits: 0.4, as the index now says
    assert (e.index_tokens, e.index_cached_tokens) == (2000, 800)
    off = Router(parse({"engines": [{"name": "e", "url": "http://127.0.0.1:1"}],
                        "scheduler": {"prefix_index_blocks": 0}}), clock=lambda: 100.0)
    off.learning.probe(off.engines[0], Measurement(1000, 0.1), 0.0, 0)
    assert off.engines[0].index_tokens == 0  # no index: nothing it is judged on


@pytest.mark.parametrize(("body", "expected"), [
    (b'{"data": [{"id": "m", "max_model_len": 2048}]}', 2048),
    (b"[" * 50_000 + b"]" * 50_000, None),  # nested past any parser's depth
    (b'{"data": [{"max_model_len": "' + b"9" * 3_000_000 + b'"}]}', None),  # over the bound
    (b'{"data": []}', None),
])
def test_an_engines_model_card_is_read_bounded(body, expected):
    """What an engine's /v1/models says only sets the probes' prompt limit: an odd or
    hostile answer gives no limit, and never fails the profile."""
    async def models(_: web.Request) -> web.Response:
        return web.Response(body=body)

    async def run() -> int | None:
        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        router = Router(parse({"engines": [{"name": "a", "url": f"http://127.0.0.1:{port}"}]}))
        try:
            async with aiohttp.ClientSession() as session:
                return await _max_model_len(router.engines[0], session,
                                            aiohttp.ClientTimeout(total=10))
        finally:
            await runner.cleanup()

    assert asyncio.run(run()) == expected
