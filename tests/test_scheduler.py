"""Admission, placement and the performance model, on a fake clock."""

from __future__ import annotations

import math
import os
import weakref

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.config import parse
from narwhal.core.exchange import Body, Exchange, Headers, Immediate
from narwhal.core.placement import project
from narwhal.core.router import Router
from narwhal.core.scheduler import Dispatch, Queued, Refuse, Ticket
from narwhal.core.sizing import Sizer
from narwhal.core.steps import BUDGETS, MIN_STEPS
from narwhal.server.driver import Driver, Runtime
from narwhal.server.telemetry import parse_vllm_metrics

HDRS = {":path": "/v1/chat/completions", ":method": "POST"}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class ManualTimers:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.pending: list[list] = []

    def call_later(self, delay, callback):
        entry = [self.clock.t + delay, callback, False]
        self.pending.append(entry)

        class Handle:
            def cancel(self_inner) -> None:
                entry[2] = True
        return Handle()

    def advance(self, dt: float) -> None:
        self.clock.t += dt
        due = [e for e in self.pending if not e[2] and e[0] <= self.clock.t]
        self.pending = [e for e in self.pending if e not in due]
        for e in due:
            e[1]()


def make_router(**sections) -> tuple[Router, Clock, ManualTimers]:
    clock = Clock()
    timers = ManualTimers(clock)
    cfg = {"engines": [{"name": "fast", "url": "http://127.0.0.1:1", "prefill_tps": 4000},
                       {"name": "slow", "url": "http://127.0.0.1:2", "prefill_tps": 1000}]}
    cfg.update(sections)
    router = Router(parse(cfg), clock=clock)
    RUNTIMES[router] = Runtime(router, timers)
    router.started = True
    for e in router.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = clock.t
    return router, clock, timers


def body(tokens: int, **extra) -> bytes:
    return orjson.dumps({"messages": [{"role": "user", "content": "abcd" * tokens}]} | extra)


# Each test router's adapter side (server.driver), which sends what the core returns.
RUNTIMES: weakref.WeakKeyDictionary[Router, Runtime] = weakref.WeakKeyDictionary()


def start(router: Router, tokens: int, headers: dict | None = None) -> tuple[Exchange, list]:
    """A request driven as the gRPC adapter drives it; the list collects every action
    sent for it, including those sent later (queue dispatch, expiry)."""
    sent: list = []
    d = Driver(RUNTIMES[router], sent.extend)
    d.step(d.ex.request_headers, HDRS | (headers or {}), False)
    if not sent:
        d.step(d.ex.request_body, body(tokens), True)
    return d.ex, sent


def close(router: Router, ex: Exchange) -> None:
    """The exchange's ext_proc stream ends."""
    RUNTIMES[router].live[ex].closed()


def ticket(router: Router, tokens: int, budget_s: float = 2.0) -> Ticket:
    now = router.clock()
    return Ticket(object(), tokens, now, budget_s, now + 600)


def test_places_on_lowest_projected_ttft_then_by_decode_load():
    router, clock, _ = make_router()
    fast, slow = router.engines
    d = router.scheduler.admit(ticket(router, 1000), clock.t)
    assert isinstance(d, Dispatch) and d.engine is fast
    # fast now has 0.25 s of backlog; 0.25 + 0.25 < 1.0 on slow: fast again
    assert router.scheduler.admit(ticket(router, 1000), clock.t).engine is fast


def test_ties_broken_by_decode_load():
    router, clock, _ = make_router(engines=[
        {"name": "a", "url": "http://127.0.0.1:1"}, {"name": "b", "url": "http://127.0.0.1:2"}])
    for e in router.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = clock.t
    router.engines[0].decode = 3
    assert router.scheduler.admit(ticket(router, 10), clock.t).engine.name == "b"


def test_prompt_alone_over_budget():
    router, clock, _ = make_router()
    d = router.scheduler.admit(ticket(router, 9000, budget_s=2.0), clock.t)  # 2.25 s on fast
    assert isinstance(d, Refuse) and d.error.status == 429 and d.error.retry_after is None
    assert d.error.terminal == "refused" and "shorten the prompt" in d.error.message
    # the same request cannot succeed later: the OpenAI clients are told not to retry it
    headers = dict(d.error.headers())
    assert headers["x-should-retry"] == "false"
    assert "retry-after" not in headers and "retry-after-ms" not in headers


def test_projected_over_budget_rounds_the_overrun():
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 100}, engines=[
        {"name": "fast", "url": "http://127.0.0.1:1", "prefill_tps": 4000},
        {"name": "slow", "url": "http://127.0.0.1:2", "prefill_tps": 100}])  # never chosen
    for _ in range(8):  # 8 x 1000 tokens, 0.25 s each on fast
        d = router.scheduler.admit(ticket(router, 1000, budget_s=60), clock.t)
        assert d.engine.name == "fast"
    # fast: 2.0 s backlog + 0.75 s own + 5 ms overhead = 2.755 s; budget 0.8 s: overrun 1.955 s
    d = router.scheduler.admit(ticket(router, 3000, budget_s=0.8), clock.t)
    assert isinstance(d, Refuse) and d.error.retry_after == 2 and d.error.code == (
        "ttft_budget_exceeded")
    assert 1955 <= int(dict(d.error.headers())["retry-after-ms"]) <= 1956  # not before
    # 2.255 s against 2.0 s: overrun 0.255 s rounds to 0, and Retry-After is at least 1;
    # so is retry-after-ms (the overrun is the earliest it could fit: too early under load)
    d = router.scheduler.admit(ticket(router, 1000, budget_s=2.0), clock.t)
    assert isinstance(d, Refuse) and d.error.retry_after == 1
    headers = dict(d.error.headers())
    assert headers["retry-after"] == "1" and headers["retry-after-ms"] == "1000"
    assert "x-should-retry" not in headers  # a 429: the clients retry it anyway
    # four more ahead: 1.255 s rounds to 1 s, before it could fit; retry-after-ms does not
    for _ in range(4):
        router.scheduler.admit(ticket(router, 1000, budget_s=60), clock.t)
    d = router.scheduler.admit(ticket(router, 1000, budget_s=2.0), clock.t)
    assert isinstance(d, Refuse) and d.error.retry_after == 1, d
    assert 1255 <= int(dict(d.error.headers())["retry-after-ms"]) <= 1256, d.error.message


def test_open_mode_skips_prediction():
    router, clock, _ = make_router(admission={"mode": "open"})
    assert isinstance(router.scheduler.admit(ticket(router, 90000, 0.001), clock.t), Dispatch)


def test_phase_slots_queue_and_fifo_pump():
    router, clock, _ = make_router(admission={"mode": "open", "queue_limit": 2},
                                   scheduler={"max_prefill_per_engine": 1,
                                              "max_decode_per_engine": 1})
    s = router.scheduler
    t1, t2, t3, t4, t5 = (ticket(router, 10) for _ in range(5))
    assert isinstance(s.admit(t1, clock.t), Dispatch) and isinstance(s.admit(t2, clock.t), Dispatch)
    assert isinstance(s.admit(t3, clock.t), Queued) and isinstance(s.admit(t4, clock.t), Queued)
    full = s.admit(t5, clock.t)
    assert isinstance(full, Refuse) and full.error.code == "queue_full"
    assert full.error.terminal == "rejected" and full.error.retry_after == 1
    assert dict(full.error.headers())["retry-after-ms"] == "1000"  # the same second
    s.first_token(t1, clock.t)  # prefill -> decode: still no slot (decode limit 1)
    assert s.pump(clock.t) == []
    s.release(t1)
    assert s.pump(clock.t) == [t3]  # FIFO
    s.release(t2)
    assert s.pump(clock.t) == [t4]


def test_no_serviceable_engine_is_503():
    router, clock, _ = make_router()
    for e in router.engines:
        e.maintenance = True
    d = router.scheduler.admit(ticket(router, 10), clock.t)
    assert isinstance(d, Refuse) and d.error.code == "backend_unavailable"
    assert router.not_ready_reason() == "maintenance"


def test_stale_telemetry_makes_engines_ineligible_and_router_degraded():
    router, clock, _ = make_router()
    router.engines[0].telemetry_at = clock.t - 60
    assert [e.name for e in router.pool.serviceable(clock.t)] == ["slow"]
    router.engines[1].telemetry_at = clock.t - 60
    assert router.not_ready_reason() == "monitoring-degraded"


def test_retention_limit():
    router, clock, _ = make_router(admission={"retention_limit": 1})
    ex1, out1 = start(router, 10)
    assert isinstance(out1[0], Headers)
    _, out2 = start(router, 10)
    assert isinstance(out2[0], Immediate) and out2[0].error.code == "retention_full"
    close(router, ex1)
    _, out3 = start(router, 10)
    assert isinstance(out3[0], Headers)


def test_queued_exchange_is_sent_upstream_when_a_slot_frees():
    router, clock, timers = make_router(admission={"mode": "open"},
                                        scheduler={"max_prefill_per_engine": 1,
                                                   "max_decode_per_engine": 1})
    ex1, _ = start(router, 10)
    ex2, _ = start(router, 10)
    ex3, out3 = start(router, 10)
    assert out3 == []  # queued
    assert router.dispatched == []
    close(router, ex1)  # slot freed: the core places ex3, the adapter sends it
    assert [type(a) for a in out3] == [Headers, Body]
    assert router.dispatched == [] and ex3.wake_at == ex3.deadline
    assert router.accounting.terminal["cancelled"] == 1


def test_admission_wait_and_deadline_expire_with_504():
    router, clock, timers = make_router(admission={"mode": "open", "max_wait_ms": 500},
                                        scheduler={"max_prefill_per_engine": 1,
                                                   "max_decode_per_engine": 1})
    start(router, 10)
    start(router, 10)
    _, waiting = start(router, 10)
    _, short = start(router, 10, {"x-request-timeout-ms": "200"})
    timers.advance(0.2)
    assert short[0].error.status == 504 and "deadline" in short[0].error.message
    assert waiting == []
    timers.advance(0.3)
    assert waiting[0].error.status == 504 and "admission wait" in waiting[0].error.message
    assert router.accounting.terminal["expired"] == 2 and not router.scheduler.queue


def test_deadline_after_dispatch_before_response_headers():
    router, clock, timers = make_router()
    ex, out = start(router, 10, {"x-request-timeout-ms": "300"})
    assert isinstance(out[0], Headers)
    timers.advance(0.3)
    assert out[-1].error.status == 504
    assert router.engines[0].in_flight == 0 and router.held == 0


def test_client_deadline_cannot_exceed_the_configured_one():
    router, clock, timers = make_router(admission={"request_timeout_ms": 1000})
    ex, _ = start(router, 10, {"x-request-timeout-ms": "999999"})
    assert ex.deadline == pytest.approx(clock.t + 1.0)


def test_sizer_learns_the_engine_ratio():
    s = Sizer(4.0)
    assert s.estimate(400) == 100
    for _ in range(60):
        s.learn(300, 100)  # 3 bytes per token
    assert s.bytes_per_token == pytest.approx(3.0, abs=0.01)
    s.learn(300, True)  # not trusted
    s.learn(300, -5)
    assert s.samples == 60


def test_parse_vllm_metrics():
    text = ('# HELP x\nvllm:num_requests_running{model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{model_name="m"} 2\nvllm:kv_cache_usage_perc 0.5\n'
            'vllm:other 9\nvllm:num_requests_running{model_name="n"} 1\nbad line\n')
    assert parse_vllm_metrics(text) == {"running": 4.0, "waiting": 2.0, "kv_cache_usage": 0.5}
    info = ('vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
            'num_gpu_blocks="1000",prefix_caching_hash_algo="sha256"} 1.0\n'
            'vllm:cache_config_info{block_size="x",num_gpu_blocks="9"} 1.0\n')
    assert parse_vllm_metrics(info) == {"kv_capacity_tokens": 16000.0}
    hostile = ('vllm:prefix_cache_queries_total NaN\nvllm:prefix_cache_hits_total +Inf\n'
               'vllm:num_requests_waiting -3\nvllm:kv_cache_usage_perc 1e999\n'
               'vllm:num_requests_running 2\n')
    assert parse_vllm_metrics(hostile) == {"running": 2.0}
    crlf = 'vllm:num_requests_waiting{model_name="m"} 2\r\nvllm:kv_cache_usage_perc 0.5\r\n'
    assert parse_vllm_metrics(crlf) == {"waiting": 2.0, "kv_cache_usage": 0.5}
    # the first 1,024 lines read are summed; a body's thousands more are not each parsed
    many = 'vllm:kv_cache_usage_perc_bucket{le="1"} 5\n' * 3 + "vllm:num_requests_running 1\n" * 1100
    assert parse_vllm_metrics(many) == {"running": 1024.0}


def test_the_prefix_index_is_bounded_by_the_engines_cache():
    router, clock, _ = make_router()  # configured bound: 65536 blocks
    fast = router.engines[0]
    fast.prefix.insert(list(range(5000)))
    # 16000 tokens of KV cache, 16 tokens a block: 1000 blocks
    router.pool.observe_kv_capacity(fast, 16000, 16.0)
    assert fast.kv_capacity_tokens == 16000 and fast.prefix.capacity == 1000
    assert len(fast.prefix.blocks) == 1000 and fast.prefix.evictions == 4000
    assert fast.prefix.match(list(range(4000, 4010))) == 10  # the newest stayed
    router.pool.observe_kv_capacity(fast, 10**9, 16.0)
    assert fast.prefix.capacity == 65536  # never past the configured bound


def test_tokenizer_file_sizes_prompts(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from narwhal.core.request import parse_request

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["narwhal tusk ocean"], trainers.WordLevelTrainer(
        special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    sizer = Sizer(4.0, str(path))
    req = parse_request("/v1/chat/completions", orjson.dumps(
        {"messages": [{"role": "user", "content": "narwhal tusk"},
                      {"role": "user", "content": [{"type": "text", "text": "ocean deep"}]}]}),
        "m")
    assert sizer.estimate(req.prompt_bytes, req.prompt_text) == 4  # words, not bytes / 4
    router, clock, _ = make_router(sizing={"tokenizer": str(path)})
    ex, _ = start(router, 0)
    assert ex.ticket.tokens == 1  # "abcd" * 0 -> empty text -> at least one token


def test_tokenizer_config_errors(tmp_path):
    from narwhal.config import ConfigError
    from narwhal.core.sizing import SizingError

    with pytest.raises(ConfigError, match="expected an existing tokenizer file"):
        parse({"sizing": {"tokenizer": str(tmp_path / "missing.json")}})
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SizingError, match="cannot load"):
        Sizer(4.0, str(bad))


def test_discovery_reconcile_adds_retires_and_drains():
    from narwhal.config import Discovery
    from narwhal.server.discovery import engine_configs

    router, clock, _ = make_router(engines=[])
    d = Discovery("dns", "vllm.svc", port=8000)
    s, pool = router.scheduler, router.pool
    added, retired = pool.reconcile(engine_configs(d, {"10.0.0.1", "10.0.0.2"}))
    assert sorted(added) == ["vllm.svc/10.0.0.1", "vllm.svc/10.0.0.2"] and retired == []
    for e in router.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = clock.t
    t = ticket(router, 10)
    busy = s.admit(t, clock.t).engine
    gone = "10.0.0.1" if busy.endpoint.startswith("10.0.0.2") else "10.0.0.2"
    keep = busy.endpoint.split(":")[0]
    _, retired = pool.reconcile(engine_configs(d, {gone, "fd00::5"}))
    assert retired == [busy.name]
    assert busy in router.engines and not busy.serviceable(clock.t, 60)  # draining
    assert [e.endpoint for e in router.engines if e.name.endswith("fd00::5")] == ["[fd00::5]:8000"]
    s.release(t)
    assert busy not in router.engines  # dropped once drained
    assert keep not in [e.endpoint.split(":")[0] for e in router.engines]


def test_destination_names_ranked_fallbacks_and_the_served_engine_takes_the_request():
    router, clock, _ = make_router(engines=[
        {"name": "fast", "url": "http://127.0.0.1:1", "prefill_tps": 4000},
        {"name": "mid", "url": "http://127.0.0.1:2", "prefill_tps": 2000},
        {"name": "slow", "url": "http://127.0.0.1:3", "prefill_tps": 1000}])
    for e in router.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = clock.t
    fast, mid, slow = router.engines
    ex, out = start(router, 200)
    headers = out[0]
    assert isinstance(headers, Headers)
    dest = dict(headers.set)["x-gateway-destination-endpoint"]
    assert dest == headers.destination == "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"
    work, backlog = fast.prefill_work, fast.decode_backlog
    assert fast.prefill == 1 and fast.dispatched == 1 and work > 0
    # Envoy could not connect to fast and reports that mid served.
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False,
                        served="127.0.0.1:2")
    assert ex.engine is mid and ex.ticket.engine is mid and ex.ticket.failover
    assert (fast.prefill, fast.dispatched, fast.failovers, fast.prefill_work) == (0, 0, 1, 0)
    assert (mid.prefill, mid.dispatched, mid.prefill_work, mid.decode_backlog) == (
        1, 1, work, backlog)
    samples = mid.model.samples
    router.scheduler.first_token(ex.ticket, clock.t + 0.5)
    assert mid.model.samples == samples  # a failed-over TTFT teaches neither engine
    router.scheduler.release(ex.ticket)
    assert fast.in_flight == mid.in_flight == 0


def test_served_by_the_chosen_engine_or_an_unknown_one_moves_nothing():
    router, clock, _ = make_router(scheduler={"fallbacks": 0})
    fast, slow = router.engines
    ex, out = start(router, 200)
    assert dict(out[0].set)["x-gateway-destination-endpoint"] == "127.0.0.1:1"
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False,
                        served="127.0.0.1:1")
    assert ex.engine is fast and fast.failovers == 0
    t = ticket(router, 10)
    router.scheduler.admit(t, clock.t)
    placed = t.engine
    assert router.scheduler.served_by(t, "10.9.9.9:80") is None and t.engine is placed


def waiting_for_fast() -> tuple[Router, Clock, Ticket, Ticket]:
    """fast (4000 tok/s) has one prefill slot, taken by t1; slow (1000 tok/s) has room
    but would take 1.5 s for t2's 1500 tokens against its 1 s budget: t2 waits for fast."""
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 1})
    s = router.scheduler
    fast, slow = router.engines
    t1 = ticket(router, 100, budget_s=1.0)
    assert s.admit(t1, clock.t).engine is fast
    t2 = ticket(router, 1500, budget_s=1.0)
    assert isinstance(s.admit(t2, clock.t), Queued) and slow.prefill == 0
    return router, clock, t1, t2


def test_a_request_waits_for_the_engine_that_keeps_its_budget_rather_than_break_it():
    # admitted on fast's projection, t2 must wait for fast's slot, not go to slow
    router, clock, t1, t2 = waiting_for_fast()
    s = router.scheduler
    fast = router.engines[0]
    s.first_token(t1, clock.t + 0.05)
    clock.t += 0.05
    assert s.pump(clock.t) == [t2] and t2.engine is fast


def test_a_waiting_request_holds_back_no_later_one_that_another_engine_serves_in_budget():
    # t2 waits for fast's one slot; t3, small, fits slow's budget: it is placed there at
    # once instead of queueing behind t2 (the head-of-line blocking that left slower
    # engines idle under a queue). t2 keeps its claim on fast: the slot fast frees next
    # is t2's, not a later request's.
    router, clock, t1, t2 = waiting_for_fast()
    s = router.scheduler
    fast, slow = router.engines
    t3 = ticket(router, 100, budget_s=1.0)
    assert isinstance(s.admit(t3, clock.t), Queued)  # a queue exists: it joins it ...
    assert s.pump(clock.t) == [t3] and t3.engine is slow  # ... and goes past t2 to slow
    assert list(s.queue) == [t2] and t2.engine is None
    t4 = ticket(router, 100, budget_s=1.0)  # slow's slot is t3's now; fast is t2's
    assert isinstance(s.admit(t4, clock.t), Queued) and s.pump(clock.t) == []
    s.first_token(t1, clock.t + 0.05)
    clock.t += 0.05
    assert s.pump(clock.t) == [t2] and t2.engine is fast and list(s.queue) == [t4]


def test_a_later_request_does_not_take_an_engine_an_earlier_waiting_one_could_use():
    # t2 may go to either engine in its budget, but placing it would take each past the
    # backlog its measurements have verified (verified-backlog: it waits for the backlog
    # to drain). t3 is small enough to fit within slow's verified backlog; were it placed
    # there, the backlog t2 waits on would grow: it waits behind t2 instead.
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 4})
    s = router.scheduler
    fast, slow = router.engines
    for e in (fast, slow):
        e.verified_work = 1000.0
    t1 = ticket(router, 900, budget_s=60.0)
    assert s.admit(t1, clock.t).engine is fast
    t0 = ticket(router, 900, budget_s=60.0)
    assert s.admit(t0, clock.t).engine is slow  # both engines now hold 900 of 1,500
    t2 = ticket(router, 1000, budget_s=60.0)
    assert isinstance(s.admit(t2, clock.t), Queued)
    t3 = ticket(router, 100, budget_s=60.0)
    assert isinstance(s.admit(t3, clock.t), Queued)
    assert s.pump(clock.t) == [] and list(s.queue) == [t2, t3]
    s.first_token(t0, clock.t + 0.5)  # slow's backlog drains: t2 first, then t3
    clock.t += 0.5
    assert s.pump(clock.t) == [t2, t3] and t2.engine is slow


def test_a_queued_request_no_engine_can_serve_in_budget_any_more_is_refused_with_the_overrun():
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 1})
    s = router.scheduler
    fast, slow = router.engines
    t1 = ticket(router, 100, budget_s=1.0)
    s.admit(t1, clock.t)
    t2 = ticket(router, 1500, budget_s=1.0)
    assert isinstance(s.admit(t2, clock.t), Queued)
    t3 = ticket(router, 10, budget_s=5.0)  # behind it, and patient
    assert isinstance(s.admit(t3, clock.t), Queued)
    clock.t += 0.9  # fast still busy; 0.9 s waited + 0.38 s on fast > 1 s: nowhere in budget
    assert s.pump(clock.t) == [t2, t3]  # given up, and the next one placed past it
    assert t2.engine is None and t2.refusal is not None and t2.refusal.status == 429
    assert t2.refusal.code == "ttft_budget_exceeded" and t2.refusal.retry_after == 1
    assert t3.refusal is None and t3.engine is slow and not s.queue
    assert fast.prefill == 1 and slow.prefill == 1  # t1 and t3: nothing booked for t2
    assert s.gave_up == 1  # counted apart from admission's refusals (/status, /metrics)
    assert t2.refusal.message.endswith(" after 900 ms in the admission queue; retry later")


def test_in_open_mode_a_queued_request_past_its_budget_goes_to_the_best_slot():
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 1},
                                   admission={"mode": "open"})
    s = router.scheduler
    fast, slow = router.engines
    t1, t2, t3 = (ticket(router, n, budget_s=1.0) for n in (100, 100, 1500))
    assert s.admit(t1, clock.t).engine is fast and s.admit(t2, clock.t).engine is slow
    assert isinstance(s.admit(t3, clock.t), Queued)
    clock.t += 0.9
    s.first_token(t2, clock.t)  # slow frees first: waiting for fast helps no one now
    assert s.pump(clock.t) == [t3] and t3.engine is slow and t3.refusal is None


def test_a_queued_request_given_up_is_answered_429_and_counted_refused():
    router, clock, timers = make_router(scheduler={"max_prefill_per_engine": 1})
    first, _ = start(router, 100)
    second, _ = start(router, 100)
    assert first.engine is not None and second.engine is not None
    late, sent = start(router, 1500, {"x-slo-ttft-ms": "1000"})
    assert sent == [] and len(router.scheduler.queue) == 1
    timers.advance(0.9)
    router.scheduler.first_token(first.ticket, clock.t)
    router.pump()
    RUNTIMES[router].drain()
    assert len(sent) == 1 and isinstance(sent[0], Immediate)
    err = sent[0].error
    assert (err.status, err.code, err.retry_after) == (429, "ttft_budget_exceeded", 1)
    assert late.terminal == "refused" and router.accounting.terminal["refused"] == 1
    assert not router.scheduler.queue and late.ticket.engine is None


def test_requests_ahead_in_prefill_count_as_the_decodes_they_become():
    router, clock, _ = make_router()
    fast = router.engines[0]
    fast.model.ttft.theta[2] = 1.0  # slope grows with the sequences sharing the steps
    t = ticket(router, 1000)
    before = project(fast, t).ttft_s
    fast.prefill = 5
    assert project(fast, t).ttft_s > before
    assert router.scheduler.admit(ticket(router, 10), clock.t).engine is not None


def both_slots_taken(**admission) -> tuple[Router, Clock, list[Ticket]]:
    """One prefill slot per engine, each taken by a request with a 60 s budget (returned
    in dispatch order): what arrives next queues."""
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 1},
                                   admission=admission)
    running = [ticket(router, 10, budget_s=60) for _ in range(2)]
    for t in running:
        assert isinstance(router.scheduler.admit(t, clock.t), Dispatch)
    return router, clock, running


def later(router: Router, clock: Clock, dt: float) -> None:
    """``dt`` seconds on, the engines still reporting (their telemetry fresh)."""
    clock.t += dt
    for e in router.engines:
        e.telemetry_at = clock.t


def served_in_turn(router: Router, clock: Clock, running: list[Ticket], labels: dict,
                   turns: int) -> list:
    """Each 0.5 s the oldest running request's first token frees its slot and the queue is
    pumped: the labels (by ticket id) of the requests dispatched, in turn."""
    out = []
    for _ in range(turns):
        clock.t += 0.5
        router.scheduler.first_token(running.pop(0), clock.t)
        pumped = router.scheduler.pump(clock.t)
        out += [labels[id(p)] for p in pumped]
        running += pumped
    return out


def test_prefill_token_bound_takes_a_prompt_only_where_it_fits_with_those_ahead():
    # 500 uncached prompt tokens in prefill an engine, 8 slots. A 900-token prompt, over
    # the bound alone, still goes where nothing prefills (fast); a 400-token one then fits
    # only the idle slow engine, a 50-token one beside the first only where 400 + 50 fit
    # (not fast: 950), and a second 400-token one nowhere: it queues with slots free
    # until the 900 ahead of it on fast reach their first token.
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 8,
                                              "max_prefill_tokens_per_engine": 500})
    s = router.scheduler
    fast, slow = router.engines
    big, first, small, second = (ticket(router, n, budget_s=60) for n in (900, 400, 50, 400))
    assert [s.admit(t, clock.t).engine for t in (big, first, small)] == [fast, slow, slow]
    assert isinstance(s.admit(second, clock.t), Queued)
    assert fast.prefill == 1 and slow.prefill == 2  # slots left: the tokens held it back
    clock.t += 0.5
    s.first_token(big, clock.t)
    assert s.pump(clock.t) == [second] and second.engine is fast
    # Without the bound the same requests all go at once.
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 8})
    assert all(isinstance(router.scheduler.admit(ticket(router, n, budget_s=60), clock.t),
                          Dispatch) for n in (900, 400, 50, 400))


def test_a_queue_draining_slowly_is_charged_at_its_measured_rate():
    # One prefill slot per engine and prompts the engines prefill in milliseconds: at
    # prefill speed the queue costs nothing, but it drains one request per 0.5 s (each
    # slot frees at a first token). A request behind four queued ones waits ~2 s: over a
    # 1 s budget, refused; the old projection (queued work at prefill speed) admitted it.
    router, clock, running = both_slots_taken()
    s = router.scheduler
    queued = [ticket(router, 10, budget_s=60) for _ in range(14)]
    for t in queued:
        assert isinstance(s.admit(t, clock.t), Queued)
    assert s.queue_wait_s(clock.t) == 0.0  # no rate measured yet
    for _ in range(10):  # the queue drains at one request per 0.5 s
        clock.t += 0.5
        t = running.pop(0)
        s.first_token(t, clock.t)
        running += s.pump(clock.t)
    assert len(s.queue) == 4
    assert s.queue_wait_s(clock.t) == pytest.approx(2.0)
    late = ticket(router, 10, budget_s=1.0)
    decision = s.admit(late, clock.t)
    assert isinstance(decision, Refuse) and decision.error.code == "ttft_budget_exceeded"
    patient = ticket(router, 10, budget_s=5.0)
    assert isinstance(s.admit(patient, clock.t), Queued)
    assert patient.predicted_ttft_s >= 2.0  # the queue's wait, then its own projection


def test_a_queue_wait_past_the_admission_wait_limit_is_refused_at_once():
    # The queue drains one request per 0.5 s and holds four: 2 s ahead of a request
    # joining it. With admission.max_wait_ms 1.5 s a request whose 5 s budget would
    # allow that wait is refused now (429, Retry-After 1), not queued to expire 504
    # after 1.5 s; with the default 10 s it joins the queue.
    for max_wait_ms, queued in ((1500, False), (10_000, True)):
        router, clock, running = both_slots_taken(max_wait_ms=max_wait_ms)
        s = router.scheduler
        for _ in range(14):  # no drain rate measured yet: no wait charged
            assert isinstance(s.admit(ticket(router, 10, budget_s=60), clock.t), Queued)
        for _ in range(10):
            clock.t += 0.5
            s.first_token(running.pop(0), clock.t)
            running += s.pump(clock.t)
        assert len(s.queue) == 4 and s.queue_wait_s(clock.t) == pytest.approx(2.0)
        decision = s.admit(ticket(router, 10, budget_s=5.0), clock.t)
        if queued:
            assert isinstance(decision, Queued)
        else:
            assert isinstance(decision, Refuse)
            assert decision.error.code == "queue_wait_exceeded"
            assert decision.error.status == 429 and decision.error.retry_after == 1
            # 2 s ahead against the 1.5 s limit: 500 ms over, told a second
            assert dict(decision.error.headers())["retry-after-ms"] == "1000"


def test_least_work_order_gives_a_freed_slot_to_the_request_with_the_least_work():
    # One prefill slot per engine, both taken; three requests queue: a short prompt with
    # a 300-token predicted output, a 400-token prompt with none, a short prompt with 40:
    # at 4 prompt tokens an output token (the default), 1,210, 400 and 170 tokens of
    # work. FIFO serves them in that order; least-work from the least work up.
    for order, served in (("fifo", [1210, 400, 170]), ("least-work", [170, 400, 1210])):
        router, clock, running = both_slots_taken(queue_order=order)
        s = router.scheduler
        work = {}
        for tokens, output in ((10, 300), (400, 0), (10, 40)):
            t = ticket(router, tokens, budget_s=60)
            t.predicted_output = output
            assert isinstance(s.admit(t, clock.t), Queued)
            work[id(t)] = tokens + 4 * output
        assert served_in_turn(router, clock, running, work, 3) == served


def test_least_work_order_charges_a_joining_request_the_wait_behind_less_work():
    # Twelve queued (prompt, predicted output), one each 0.5 s: (10, 20), (10, 40), (100,
    # 100), (10, 500) three times; a drain rate measured over eight dispatches at one per
    # 0.5 s leaves four. FIFO: one of each, all ahead of a request joining (2 s), and no
    # later arrival goes before it. Least-work at 4 prompt tokens an output token (work 90,
    # 170, 500, 2,010): a 500 and three 2,010s are left, and a (150, 150) request (750)
    # waits behind the 500 alone (0.5 s), stretched by the arrivals with less work than
    # its own that overtake it while it waits: 9 of the 12 that joined in the last 9.5 s,
    # so W = 0.5 / (1 - 9 / 9.5 x 0.5). At 0 (work 10, 10, 100, 10): a 10 and three 100s
    # ahead, all with no more than its 150, and all 12 overtake.
    cases = (("fifo", 4.0, 2.0), ("least-work", 4.0, 0.5 / (1 - 9 / 9.5 * 0.5)),
             ("least-work", 0.0, 2.0 / (1 - 12 / 9.5 * 0.5)))
    for order, per_output, wait in cases:
        router, clock, running = both_slots_taken(queue_order=order,
                                                  output_token_work=per_output)
        s = router.scheduler
        for i in range(3):
            for j, (tokens, output) in enumerate(((10, 20), (10, 40), (100, 100), (10, 500))):
                if i or j:
                    later(router, clock, 0.5)
                t = ticket(router, tokens, budget_s=60)
                t.predicted_output = output
                assert isinstance(s.admit(t, clock.t), Queued)
        for _ in range(8):
            clock.t += 0.5
            s.first_token(running.pop(0), clock.t)
            running += s.pump(clock.t)
        assert len(s.queue) == 4
        joining = ticket(router, 150, budget_s=60)
        joining.predicted_output = 150
        joining.work_order = 150 + per_output * 150
        assert s.queue_wait_s(clock.t, joining) == pytest.approx(wait)
        joining.work_order = 0.0
        assert isinstance(s.admit(joining, clock.t), Queued)
        if order == "least-work":  # what admission computes, and charges
            assert joining.work_order == pytest.approx(150 + per_output * 150)
            assert joining.predicted_ttft_s >= wait


def test_a_joining_request_is_charged_the_higher_priorities_arriving_after_it():
    # FIFO with priorities: twelve queued one each 0.5 s, every other of priority 10; eight
    # dispatches at one per 0.5 s take the six of priority 10 first, leaving four of 0. A
    # priority-0 request joining waits behind those four (2 s), stretched by the priority-10
    # arrivals (6 in the last 9.5 s) served before it meanwhile; one of priority 10 waits
    # for nothing. Then a burst: twelve more of priority 10 at once, and the wait is capped
    # at ten times its unstretched length (OVERTAKEN_MAX), not for ever.
    router, clock, running = both_slots_taken(objectives={"interactive": 10})
    s = router.scheduler
    for i in range(12):
        if i:
            later(router, clock, 0.5)
        t = ticket(router, 10, budget_s=60)
        t.priority = 10 * (i % 2)
        assert isinstance(s.admit(t, clock.t), Queued)
    for _ in range(8):
        clock.t += 0.5
        s.first_token(running.pop(0), clock.t)
        running += s.pump(clock.t)
    assert [q.priority for q in s.queue] == [0, 0, 0, 0]
    low, high = ticket(router, 10, budget_s=60), ticket(router, 10, budget_s=60)
    high.priority = 10
    assert s.queue_wait_s(clock.t, low) == pytest.approx(2.0 / (1 - 6 / 9.5 * 0.5))
    assert s.queue_wait_s(clock.t, high) == 0.0
    for _ in range(12):
        t = ticket(router, 10, budget_s=60)
        t.priority = 10
        assert isinstance(s.admit(t, clock.t), Queued)
    # All 16 queued are ahead of a priority-0 arrival, and 18 of the 24 joins in the last
    # 9.5 s were of priority 10: 1.9 a second against a dispatch each 0.5 s.
    assert s.queue_wait_s(clock.t, low) == pytest.approx(16 * 0.5 / (1 - 0.9))


def test_least_work_order_gives_up_a_request_it_never_reaches_once_out_of_budget():
    # Both slots taken; a 2,000-token request with a 2 s budget queues, then forty
    # 10-token ones with 60 s budgets. In least-work order the pump's walk stops at the
    # first cheap one (no engine has a slot), so it never reaches the expensive one; once
    # it has waited so long that even an idle engine could not serve it within its budget
    # it is given up (429, its overrun), and the cheap ones stay queued.
    router, clock, _ = both_slots_taken(queue_order="least-work")
    s = router.scheduler
    big = ticket(router, 2000, budget_s=2.0)
    assert isinstance(s.admit(big, clock.t), Queued)
    queued_at = clock.t
    assert 0 < big.alone_s < 2.0
    for _ in range(40):
        assert isinstance(s.admit(ticket(router, 10, budget_s=60), clock.t), Queued)
    clock.t += 1.99 - big.alone_s
    assert s.pump(clock.t) == [] and big.refusal is None and s.gave_up == 0
    clock.t += 0.02
    assert s.pump(clock.t) == [big] and s.gave_up == 1
    assert big.refusal is not None and big.refusal.code == "ttft_budget_exceeded"
    waited = round((clock.t - queued_at) * 1000)
    assert f" after {waited} ms in the admission queue" in big.refusal.message
    assert len(s.queue) == 40 and all(t.refusal is None for t in s.queue)


def test_a_request_behind_a_queue_goes_at_once_where_no_queued_request_can():
    # The queue's requests may use only fast (a gateway's subset hint) and drain at one
    # per 0.5 s: 2 s of queue against a 1 s budget. A request that slow may serve is not
    # charged that wait: slow has a free slot and nothing queued can use it, so it is
    # placed there at admission (before: refused 429 with slow idle). One that only fast
    # may serve is still refused: the queue claims fast.
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 1})
    s = router.scheduler
    fast, slow = router.engines
    only_fast = frozenset({fast.endpoint})

    def to_fast(budget_s: float) -> Ticket:
        t = ticket(router, 10, budget_s=budget_s)
        t.candidates = only_fast
        return t

    running = to_fast(60)
    assert s.admit(running, clock.t).engine is fast
    for _ in range(14):
        assert isinstance(s.admit(to_fast(60), clock.t), Queued)
    for _ in range(10):
        clock.t += 0.5
        s.first_token(running, clock.t)
        [running] = s.pump(clock.t)
    assert len(s.queue) == 4 and s.queue_wait_s(clock.t) == pytest.approx(2.0)
    late = ticket(router, 10, budget_s=1.0)
    decision = s.admit(late, clock.t)
    assert isinstance(decision, Dispatch) and decision.engine is slow
    assert late.predicted_ttft_s < 1.0  # slow's own projection: no queue ahead there
    assert len(s.queue) == 4
    refused = s.admit(to_fast(1.0), clock.t)
    assert isinstance(refused, Refuse) and refused.error.code == "ttft_budget_exceeded"
    # slow's one slot is taken now: the next request waits (it may still use fast)
    assert isinstance(s.admit(ticket(router, 10, budget_s=5.0), clock.t), Queued)


def test_past_the_pumps_lookahead_no_engine_is_taken_beside_the_queue():
    # The pump walks LOOKAHEAD waiting tickets and stops: the ones past it may claim any
    # engine, so a request arriving behind them joins the queue (the next pump judges it
    # in order) rather than going at once to slow, which the walked ones left free.
    from narwhal.core.scheduler import LOOKAHEAD

    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 1})
    s = router.scheduler
    fast, slow = router.engines
    first = ticket(router, 10, budget_s=60)
    first.candidates = frozenset({fast.endpoint})
    assert s.admit(first, clock.t).engine is fast
    for _ in range(LOOKAHEAD + 1):
        t = ticket(router, 10, budget_s=60)
        t.candidates = frozenset({fast.endpoint})
        assert isinstance(s.admit(t, clock.t), Queued)
    assert s.pump(clock.t) == [] and slow.prefill == 0
    assert isinstance(s.admit(ticket(router, 10, budget_s=60), clock.t), Queued)


def test_prediction_errors_are_kept_per_engine_and_for_the_pool():
    """Which engine's projections run wide is what an operator needs to see (the pool's
    p90 alone hides a slow engine mispredicted by a third behind a fast one measured to a
    few percent); /status shows each engine's window, /metrics a summary of each."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from narwhal.server.metrics import RouterCollector

    router, clock, _ = make_router()
    fast, slow = router.engines
    s = router.scheduler

    def exposed() -> dict[tuple, float]:
        reg = CollectorRegistry()
        reg.register(RouterCollector(router))
        return {(f.name, x.name, tuple(sorted(x.labels.items()))): x.value
                for f in text_string_to_metric_families(generate_latest(reg).decode())
                for x in f.samples}

    eng = "narwhal_engine_ttft_prediction_error"
    assert math.isnan(exposed()[(eng, eng, (("engine", "fast"), ("quantile", "0.9")))])
    placed = []
    for e in (fast, slow, fast):
        t = ticket(router, 100, budget_s=60)
        t.candidates = frozenset({e.endpoint})
        assert s.admit(t, clock.t).engine is e
        placed.append(t)
    clock.t += 1.0
    for t, off in zip(placed, (1.0, 1.5, 1.1), strict=True):
        t.predicted_ttft_s = off  # measured: 1 s after arrival
        s.first_token(t, clock.t)
    assert [round(x, 3) for x in fast.prediction_errors.recent] == [0.0, 0.1]
    assert [round(x, 3) for x in slow.prediction_errors.recent] == [0.5]
    assert router.learning.error_quantiles()["samples"] == 3
    assert slow.prediction_errors.summary() == {"p50": 0.5, "p90": 0.5, "mape": 0.5,
                                                "samples": 1}
    samples = exposed()
    assert samples[(eng, eng + "_count", (("engine", "fast"),))] == 2
    assert samples[(eng, eng + "_sum", (("engine", "slow"),))] == pytest.approx(0.5)
    assert samples[(eng, eng, (("engine", "slow"), ("quantile", "0.9")))] == pytest.approx(0.5)
    pool = "narwhal_ttft_prediction_error"
    assert samples[(pool, pool + "_count", ())] == 3
    assert samples[(pool, pool + "_sum", ())] == pytest.approx(0.6)


def test_every_token_marks_an_engine_steps_end_and_the_next_request_waits_out_the_rest():
    """An engine takes new work only when its step under way ends, and every running
    sequence's token leaves at a step's end: the exchange marks each token's arrival on
    the engine, and the next request's projection counts what is left of the step (the
    feature the TTFT fit learns from, recorded at dispatch)."""
    from narwhal.sim.generate import SimOptions, make_plan, stream_events

    router, clock, _ = make_router()
    fast, _slow = router.engines
    ex, out = start(router, 50, {"x-gateway-destination-endpoint-subset": fast.endpoint})
    assert ex.engine is fast
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False,
                        served=fast.endpoint)
    plan = make_plan(orjson.loads(out[1].data), SimOptions(), None, None)
    marks = []
    for _, data in stream_events(plan):
        clock.t += 0.05
        ex.response_body(data, False)
        marks.append(fast.model.last_step_at)
    assert ex.ticket.first_token_at is not None
    assert len(set(marks)) > 5  # each token event moved the mark ...
    assert fast.model.last_step_at == ex.last_token_at > ex.ticket.first_token_at  # to it
    # A loaded prefill step of 0.6 s seen from first tokens, and a request in prefill.
    fast.model.observe_first_token(clock.t + 0.4, dispatched_at=clock.t)
    fast.model.observe_first_token(clock.t + 1.0, dispatched_at=clock.t + 0.3)
    clock.t += 1.2  # the step that ended at +1.0 is 0.2 s into the next
    start(router, 50, {"x-gateway-destination-endpoint-subset": fast.endpoint})
    assert fast.prefill == 1
    fast.verified_work = 10_000  # backlogs this large measured here: no extrapolation
    t = ticket(router, 100)
    t.candidates = frozenset({fast.endpoint})
    c = project(fast, t, now=clock.t)
    assert c.step_wait_s == pytest.approx(0.4)
    assert c.ttft_s == pytest.approx(fast.model.ttft_s(fast.prefill_work + c.work,
                                                       fast.decode + fast.prefill, 0.4))
    assert isinstance(router.scheduler.admit(t, clock.t), Dispatch)
    assert t.step_wait == pytest.approx(0.4)


def test_the_step_model_follows_the_engine_through_the_exchange():
    """Every token the exchange relays reaches the engine's step model: a stream of
    steps 50 ms apart marks them; a step that computed a prompt sent meanwhile teaches
    the step length (a decode-only step does not); the next request's projection counts
    whole steps and is recorded on its ticket at dispatch; a first token relayed through
    its exchange judges the projections and ends the following of that prompt."""
    from narwhal.sim.generate import SimOptions, make_plan, stream_events

    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 16})
    fast, _slow = router.engines
    steps = fast.model.step_model
    pin = {"x-gateway-destination-endpoint-subset": fast.endpoint}
    ex, out = start(router, 50, pin)
    handle = ex.ticket.prefill
    assert handle is not None and handle in steps.queue
    ex.response_headers({":status": "200", "content-type": "text/event-stream"}, False,
                        served=fast.endpoint)
    plan = make_plan(orjson.loads(out[1].data), SimOptions(), None, None)
    events = iter(list(stream_events(plan)))

    def relay(n: int) -> None:  # the stream's next n events, 50 ms apart
        for _ in range(n):
            clock.t += 0.05
            ex.response_body(next(events)[1], False)

    relay(4)
    assert not handle.alive and ex.ticket.prefill is None  # answered: no longer followed
    assert steps.judged == 1
    length = steps.lengths[BUDGETS.index(steps.budget)]
    assert len(length) == 0  # decode-only steps so far
    for _ in range(MIN_STEPS):  # a prompt sent in each step is computed in the next
        start(router, 400, pin)
        relay(2)
    assert len(length) == MIN_STEPS
    assert length.seconds(1 + 400) == pytest.approx(0.05)
    ex2, _ = start(router, 400, pin)
    t = ex2.ticket
    assert t.engine is fast and t.steps_s > 0
    assert t.steps_s == pytest.approx(t.prefill.projected[BUDGETS.index(steps.budget)])
    assert steps.summary()["following"] == MIN_STEPS + 1  # no first tokens for these yet


def prioritized(router: Router, tokens: int, priority: int, output: int = 0) -> Ticket:
    t = ticket(router, tokens, budget_s=60)
    t.priority, t.predicted_output = priority, output
    return t


def test_a_higher_priority_takes_freed_slots_first_in_the_queue_order_among_equals():
    """admission.objectives' priorities: queued requests of a higher priority leave the
    queue before any of a lower, in the configured order among themselves (arrival, or
    the least work)."""
    for order, served in (("fifo", ["high-1", "high-2", "low-1", "low-2"]),
                          ("least-work", ["high-2", "high-1", "low-2", "low-1"])):
        router, clock, running = both_slots_taken(queue_order=order)
        s = router.scheduler
        names = {}
        # (name, priority, predicted output): the second of each priority the least work
        for name, priority, output in (("low-1", 0, 300), ("high-1", 5, 300),
                                       ("low-2", 0, 10), ("high-2", 5, 10)):
            t = prioritized(router, 10, priority, output)
            assert isinstance(s.admit(t, clock.t), Queued)
            names[id(t)] = name
        assert served_in_turn(router, clock, running, names, 4) == served
        assert s.prioritized == 0


def test_a_joining_request_is_charged_the_wait_behind_its_priority_and_above():
    """The queue drains one request per 0.5 s and holds four of priority 0: a request of
    priority 0 joining it waits behind all four (2 s), one of priority 1 behind none, and
    the queued tokens ahead of it are those of its priority and above. Once one of
    priority 1 has joined (one of the 15 joins in the last 5 s), a request of priority 0
    is charged its wait stretched by such arrivals overtaking it: / (1 - 1 / 5 x 0.5)."""
    router, clock, running = both_slots_taken()
    s = router.scheduler
    for _ in range(14):
        assert isinstance(s.admit(prioritized(router, 10, 0), clock.t), Queued)
    for _ in range(10):
        clock.t += 0.5
        s.first_token(running.pop(0), clock.t)
        running += s.pump(clock.t)
    assert len(s.queue) == 4
    assert s.queue_wait_s(clock.t, prioritized(router, 10, 0)) == pytest.approx(2.0)
    assert s.queue_wait_s(clock.t, prioritized(router, 10, 1)) == 0.0
    usual, urgent = prioritized(router, 10, 0), prioritized(router, 10, 1)
    assert isinstance(s.admit(urgent, clock.t), Queued) and s.prioritized == 1
    s.admit(usual, clock.t)
    # the same projection but for the queue's 2 s and the urgent one's 0.5 s, now ahead
    stretched = 2.5 / (1 - 1 / 5 * 0.5)
    assert usual.predicted_ttft_s - urgent.predicted_ttft_s == pytest.approx(stretched,
                                                                              abs=0.05)
    s.dequeue(usual)
    assert s.queue_wait_s(clock.t, prioritized(router, 10, 1)) == pytest.approx(0.5)
    assert s.queue_wait_s(clock.t, prioritized(router, 10, 0)) == pytest.approx(stretched)
    assert s.queue_wait_s(clock.t, prioritized(router, 10, 2)) == 0.0
    clock.t += 0.5
    for e in router.engines:
        e.telemetry_at = clock.t  # still reporting
    s.first_token(running.pop(0), clock.t)
    assert s.pump(clock.t) == [urgent] and s.prioritized == 0


def test_a_sheddable_request_is_served_at_once_or_refused_not_queued():
    """A negative priority is sheddable: placed where a slot is free, else refused 429
    ``request_shed`` (a capacity rejection, Retry-After 1) while others queue."""
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 1})
    s = router.scheduler
    assert isinstance(s.admit(prioritized(router, 10, -1), clock.t), Dispatch)
    assert isinstance(s.admit(prioritized(router, 10, -1), clock.t), Dispatch)
    shed = s.admit(prioritized(router, 10, -1), clock.t)
    assert isinstance(shed, Refuse) and shed.error.code == "request_shed"
    assert shed.error.status == 429 and shed.error.terminal == "rejected"
    assert dict(shed.error.headers())["retry-after"] == "1"
    assert isinstance(s.admit(prioritized(router, 10, 0), clock.t), Queued)
    assert not any(t.priority < 0 for t in s.queue)


def test_a_request_names_its_objective_by_either_header():
    router, clock, _ = make_router(admission={"objectives": {"interactive": 10,
                                                             "batch": -1}})
    for headers, priority in (({"x-gateway-inference-objective": "interactive"}, 10),
                              ({"x-llm-d-inference-objective": "batch"}, -1),
                              ({"x-gateway-inference-objective": "unknown"}, 0), ({}, 0)):
        ex, sent = start(router, 10, headers)
        assert ex.ticket is not None and ex.ticket.priority == priority, headers
        assert isinstance(sent[0], Headers)
        close(router, ex)
        record = ex.record()
        assert record is not None and record.priority == priority  # what tracing reads


def test_the_queue_is_counted_by_priority():
    router, clock, _ = both_slots_taken()
    s = router.scheduler
    assert s.queued_by_priority() == {}
    for priority in (0, 3, 0, 3, 7):
        assert isinstance(s.admit(prioritized(router, 10, priority), clock.t), Queued)
    assert s.queued_by_priority() == {0: 2, 3: 2, 7: 1}


def flowing(router: Router, flow: str, priority: int = 0, output: int = 0) -> Ticket:
    t = prioritized(router, 10, priority, output)
    t.flow = flow
    return t


def test_round_robin_fairness_gives_the_flows_of_a_priority_turns():
    """admission.fairness: round-robin: a flow that queued six requests at once and two
    that queued one each later take freed slots in turn (by name from the flow after the
    last served), not in arrival order; a higher priority still goes first; without the
    setting, arrival order."""
    for fairness, served in (
            ("round-robin", ["hi", "a1", "b1", "c1", "a2", "a3", "a4"]),
            ("none", ["hi", "a1", "a2", "a3", "a4", "a5", "a6"])):
        router, clock, running = both_slots_taken(fairness=fairness)
        s = router.scheduler
        names = {}
        arrivals = [("a1", "a"), ("a2", "a"), ("a3", "a"), ("a4", "a"), ("a5", "a"),
                    ("a6", "a"), ("c1", "c"), ("b1", "b")]
        for name, flow in arrivals:
            t = flowing(router, flow)
            assert isinstance(s.admit(t, clock.t), Queued)
            names[id(t)] = name
        urgent = flowing(router, "z", priority=3)
        assert isinstance(s.admit(urgent, clock.t), Queued)
        names[id(urgent)] = "hi"
        assert served_in_turn(router, clock, running, names, 7) == served, fairness


def test_a_joining_request_is_charged_the_wait_of_the_turns_before_its_own():
    """The queue drains one request per 0.5 s and holds four of flow "warm", which had
    the last turn; then six of flow "a" and one of "b" join (fairness round-robin: turns
    by name from "a"). A request of a new flow "c" waits behind a's first and b's (1 s),
    another of "b" behind b's own, a's first two and warm's first (2 s), another of "a"
    behind a's six, b's one and warm's four (5.5 s); without fairness, behind all eleven.
    With fairness each wait is stretched by the later arrivals of other flows that will
    take their turns first, at the rate such requests joined (21 in the last 5 s): those
    that joined with fewer of their flow queued before them than it has of its own (none
    for c; warm's first and a's first for b; warm's first six and b's for a), / (1 - r x
    0.5). The queued tokens charged to its projection are those it waits behind."""
    stretch = 1 / 5 * 0.5  # r x d for each overtaking join in the 5 s span
    for fairness, waits in (("round-robin", {"c": 1.0, "b": 2.0 / (1 - 2 * stretch),
                                             "a": 5.5 / (1 - 7 * stretch)}),
                            ("none", {"c": 5.5, "b": 5.5, "a": 5.5})):
        router, clock, running = both_slots_taken(fairness=fairness)
        s = router.scheduler
        for _ in range(14):
            assert isinstance(s.admit(flowing(router, "warm"), clock.t), Queued)
        for _ in range(10):  # the drain rate
            clock.t += 0.5
            s.first_token(running.pop(0), clock.t)
            running += s.pump(clock.t)
        assert len(s.queue) == 4 and s.last_flow.get(0, "warm") == "warm"
        for flow in "aaaaaab":
            assert isinstance(s.admit(flowing(router, flow), clock.t), Queued)
        for flow, wait in waits.items():
            assert s.queue_wait_s(clock.t, flowing(router, flow)) == pytest.approx(wait), (
                fairness, flow)
        c, b = flowing(router, "c"), flowing(router, "b")
        s.admit(c, clock.t)
        s.dequeue(c)  # its join still counts: c's first overtakes the second b too
        s.admit(b, clock.t)
        b_wait = waits["b"] if fairness == "none" else 2.0 / (1 - 3 * stretch)
        # the same projection but for the wait and the prefill of the two more requests'
        # tokens ahead of b (~0.01 s on this pool)
        assert 0 <= b.predicted_ttft_s - c.predicted_ttft_s - (b_wait - waits["c"]) < 0.1


def test_in_the_least_work_order_the_queued_tokens_charged_are_its_whole_flows():
    """Admission charges a joining request the queued prompts' prefill before placement
    has set its work order: in the least-work order, every queued request of its flow
    and priority (as without fairness, every one of its priority). With one flow queued,
    fairness changes nothing of the projection."""
    predicted = {}
    for fairness in ("none", "round-robin"):
        router, clock, _ = both_slots_taken(queue_order="least-work", fairness=fairness)
        s = router.scheduler
        for _ in range(3):
            assert isinstance(s.admit(flowing_tokens(router, "a", 2000), clock.t), Queued)
        joining = flowing_tokens(router, "a", 10)
        s.admit(joining, clock.t)
        predicted[fairness] = joining.predicted_ttft_s
    assert predicted["round-robin"] == pytest.approx(predicted["none"])
    # and the 6,000 queued tokens are in it: more than a request behind an empty queue
    router, clock, _ = both_slots_taken(queue_order="least-work", fairness="round-robin")
    alone = flowing_tokens(router, "a", 10)
    router.scheduler.admit(alone, clock.t)
    assert predicted["round-robin"] > alone.predicted_ttft_s + 0.1


def flowing_tokens(router: Router, flow: str, tokens: int) -> Ticket:
    t = prioritized(router, tokens, 0)
    t.flow = flow
    return t


def test_a_request_names_its_flow_by_either_header_within_a_bound():
    router, clock, _ = make_router(admission={"fairness": "round-robin"})
    for headers, flow in (({"x-gateway-inference-fairness-id": "tenant-1"}, "tenant-1"),
                          ({"x-llm-d-inference-fairness-id": "tenant-2"}, "tenant-2"),
                          ({}, "")):
        ex, sent = start(router, 10, headers)
        assert ex.ticket is not None and ex.ticket.flow == flow, headers
        close(router, ex)
        record = ex.record()
        assert record is not None and record.flow == flow  # what tracing reads
    ex, sent = start(router, 10, {"x-gateway-inference-fairness-id": "x" * 257})
    assert ex.ticket is None and isinstance(sent[0], Immediate)
    err = sent[0].error
    assert err.status == 400 and err.param == "x-gateway-inference-fairness-id"
    assert router.held == 0
    # Without fairness the header is not read (and not bounded).
    router, clock, _ = make_router()
    ex, _ = start(router, 10, {"x-gateway-inference-fairness-id": "x" * 1000})
    assert ex.ticket is not None and ex.ticket.flow == ""
    close(router, ex)


ARRIVAL = st.tuples(st.just("admit"), st.integers(1, 400), st.sampled_from([-1, 0, 0, 3, 7]),
                   st.sampled_from(["", "a", "a", "a", "b", "c"]))
OPERATIONS = st.lists(st.one_of(
    ARRIVAL, ARRIVAL, ARRIVAL,  # arrivals thrice as often: a queue forms
    st.tuples(st.just("burst"), st.lists(st.sampled_from([0, 3, 7]), min_size=2, max_size=6)),
    st.tuples(st.just("first_token"), st.integers(0, 20)),
    st.tuples(st.just("first_tokens")),  # every running request's: their slots free at once
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("leave"), st.integers(0, 20)),
    st.tuples(st.just("pump"), st.floats(0.0, 0.5))), min_size=8, max_size=60)


@settings(max_examples=int(os.environ.get("NARWHAL_FUZZ_EXAMPLES", "150")), deadline=None)
@given(OPERATIONS, st.sampled_from(["fifo", "least-work"]), st.sampled_from(["predictive",
                                                                               "open"]),
       st.sampled_from(["none", "round-robin"]))
def test_the_queue_keeps_its_priority_invariants(operations, order, mode, fairness):
    """Any sequence of arrivals (of any priority and flow), first tokens, ends, clients
    leaving the queue and pumps: the queue's counts hold, no sheddable request ever waits
    in it, each pump hands out its requests in priority order, and with round-robin
    fairness the queue's order gives the flows of a priority turns (in any prefix of a
    priority's order, two flows' counts differ by at most one unless one has no more)."""
    router, clock, _ = make_router(scheduler={"max_prefill_per_engine": 1,
                                              "max_decode_per_engine": 8},
                                   admission={"queue_order": order, "mode": mode,
                                              "fairness": fairness})
    s = router.scheduler
    running: list[Ticket] = []
    for op, *args in operations:
        if op == "admit":
            t = prioritized(router, args[0], args[1])
            t.budget_s, t.flow = 2.0, args[2]
            decision = s.admit(t, clock.t)
            if isinstance(decision, Dispatch):  # booked on its engine
                running.append(t)
        elif op == "burst":  # arrivals together, then every running request's first token
            for priority in args[0]:
                t = prioritized(router, 50, priority)
                t.budget_s = 2.0
                if isinstance(s.admit(t, clock.t), Dispatch):
                    running.append(t)
            for t in running:
                s.first_token(t, clock.t)
        elif op == "first_tokens":
            for t in running:
                s.first_token(t, clock.t)
        elif op in ("first_token", "release") and running:
            t = running[args[0] % len(running)]
            if op == "first_token":
                s.first_token(t, clock.t)
            else:
                s.release(t)
                running.remove(t)
        elif op == "leave" and s.queue:
            s.release(s.queue[args[0] % len(s.queue)])
        elif op == "pump":
            clock.t += args[0]
            for e in router.engines:
                e.telemetry_at = clock.t
            pumped = s.pump(clock.t)
            if order == "fifo":
                assert [t.priority for t in pumped] == sorted(
                    (t.priority for t in pumped), reverse=True)
            running += [t for t in pumped if t.refusal is None]
        queue = s.queue
        assert s.prioritized == sum(1 for t in queue if t.priority)
        assert s.queued_tokens == sum(t.tokens for t in queue)
        assert all(t.priority >= 0 for t in queue)
        assert s.queued_by_priority() == {p: sum(1 for t in queue if t.priority == p)
                                          for p in {t.priority for t in queue}}
        order = s._in_order()
        assert sorted(map(id, order)) == sorted(map(id, queue))
        if fairness == "round-robin":
            for p in {t.priority for t in queue}:
                band = [t.flow for t in order if t.priority == p]
                total = {f: band.count(f) for f in band}
                seen = dict.fromkeys(total, 0)
                for flow in band:
                    seen[flow] += 1
                    assert all(seen[flow] <= seen[g] + 1 or seen[g] == total[g]
                               for g in total), band


QUEUED = st.lists(st.tuples(st.sampled_from([0, 0, 3]), st.sampled_from(["", "a", "b", "c"]),
                            st.integers(0, 5)), max_size=24)


@settings(max_examples=int(os.environ.get("NARWHAL_FUZZ_EXAMPLES", "150")), deadline=None)
@given(QUEUED, st.tuples(st.sampled_from([0, 3]), st.sampled_from(["", "a", "b", "d"]),
                         st.integers(0, 5)),
       st.sampled_from(["fifo", "least-work"]),
       st.dictionaries(st.sampled_from([0, 3]), st.sampled_from(["", "a", "b", "c", "z"])))
def test_the_wait_charged_is_the_turns_the_order_puts_first(queued, joining, order, last):
    """``_fair_ahead`` (what a joining request is charged) and ``_fair_order`` (the order
    the pump walks) are written apart: for any queue of priorities, flows and amounts of
    work, any flows last served and either queue order, the requests charged ahead of a
    joining one are exactly those the order puts before it once it has joined."""
    router, _, _ = make_router(admission={"fairness": "round-robin", "queue_order": order})
    s = router.scheduler
    s.last_flow = dict(last)

    def join(priority: int, flow: str, work: int) -> Ticket:
        t = flowing(router, flow, priority)
        t.work_order = float(work)
        s.queue.append(t)
        s.prioritized += bool(priority)
        return t

    for args in queued:
        join(*args)
    priority, flow, work = joining
    probe = flowing(router, flow, priority)
    probe.work_order = float(work)
    charged = {id(q) for q in s._fair_ahead(probe)}
    t = join(priority, flow, work)
    walked = s._in_order()
    assert charged == {id(q) for q in walked[:walked.index(t)]}
