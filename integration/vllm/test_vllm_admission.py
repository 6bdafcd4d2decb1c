"""Predictive admission in front of real vLLM: the engine is learned from outside (its
profile's probes, identified by token IDs), and the seed's predictive rows hold on what
was learned.

The row "projected total over the budget although the prompt alone fits" needs a backlog
held on the engine while the request arrives. The tiny model prefills a prompt in
milliseconds, so that row runs on the "small" model's engine (``small_pair``), whose
prefill of a long prompt takes about a second on this CPU: a burst of them is a backlog
of several budgets, held by the engine itself.
"""

from __future__ import annotations

import itertools
import re
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed

import httpx
import openai
import pytest

from ..conftest import wait_for
from .conftest import SMALL_BUDGET_MS
from .engine import SERVED_MODEL
from .test_vllm_requests import CHAT, MSGS

BODY = {"model": SERVED_MODEL, "messages": MSGS, "max_tokens": 4}


def test_the_engine_is_profiled_from_its_token_ids(tools_pair):
    st = tools_pair.engine_status()
    assert st["profiled"] and st["eligible"] and st["profile_error"] is None
    assert st["profiles"] >= 1 and st["token_accounting"] == "token_ids"
    assert st["model_samples"] >= 1 and st["tpot_ms"] > 0


def test_a_prompt_over_the_budget_alone_is_refused_without_retry_after(tools_pair):
    # A microsecond: under any projection (one is at least a millisecond), however fast
    # the machine's CPU vLLM prefills.
    before = tools_pair.stack_counts()
    with tools_pair.routed() as c:
        resp = c.post(CHAT, json=BODY, headers={"x-slo-ttft-ms": "0.001"})
    assert resp.status_code == 429 and "retry-after" not in resp.headers
    assert resp.headers["x-should-retry"] == "false"  # the OpenAI clients do not retry it
    error = resp.json()["error"]
    assert error["code"] == "prompt_exceeds_ttft_budget" and error["type"] == "rate_limit_error"
    assert tools_pair.stack_counts()["refused"] == before["refused"] + 1
    # its default retries: none taken
    client = openai.OpenAI(base_url=f"{tools_pair.stack.url}/v1", api_key="-")
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=SERVED_MODEL, messages=MSGS, max_tokens=4,
                                       extra_headers={"x-slo-ttft-ms": "0.001"})
    assert info.value.code == "prompt_exceeds_ttft_budget"
    assert tools_pair.stack_counts()["refused"] == before["refused"] + 2


def test_a_tpot_budget_no_engine_meets_is_refused_with_retry_after(tools_pair):
    learned_ms = tools_pair.engine_status()["tpot_ms"]
    assert learned_ms > 0.01  # what the profile's token intervals measured
    # Half the learned pace, in decimal milliseconds: a CPU vLLM with the tiny model
    # decodes in about a millisecond a token, on some machines under one.
    budget = f"{learned_ms / 2:.3f}"
    with tools_pair.routed() as c:
        resp = c.post(CHAT, json=BODY, headers={"x-slo-tpot-ms": budget})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "tpot_budget_exceeded"


def test_an_admitted_request_carries_its_projection(tools_pair):
    with tools_pair.routed() as c:
        resp = c.post(CHAT, json=BODY, headers={"x-slo-ttft-ms": "60000"})
    assert resp.status_code == 200, resp.text
    assert int(resp.headers["x-narwhal-predicted-ttft-ms"]) >= 1
    assert 1 <= resp.json()["usage"]["completion_tokens"] <= 4


BURST = 16  # prompts of ~1,300 tokens: ~19 s of this CPU's prefill, about five budgets


def _long_body(i: int) -> dict:
    words = " ".join(f"narwhal{(i * 7919 + j) % 997} tusk" for j in range(330))
    return {"model": SERVED_MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": f"{i}: {words}"}]}


def test_a_request_behind_a_backlog_over_the_budget_is_refused_with_its_overrun(small_pair):
    """Sixteen long prompts at once: each alone fits the budget (projected ~1.2 s of
    prefill on an idle engine, against 4 s), together they are about five budgets. The
    first is admitted and held by vLLM (more where the projection allows; measured: one,
    the second projected at 4.0-4.7 s behind it, the one-step floor included); the rest
    are projected over the budget and refused with 429 ``ttft_budget_exceeded`` and a
    Retry-After of their overrun rounded to whole seconds (at least 1). Every admitted one
    completes, the counters hold, and a refused request sent again once the backlog is
    gone is admitted: its prompt alone did fit."""
    before = small_pair.stack_counts()
    bodies = [_long_body(i) for i in range(BURST)]
    with httpx.Client(base_url=small_pair.stack.url, timeout=120) as c, \
            ThreadPoolExecutor(BURST) as pool:
        responses = list(pool.map(lambda b: c.post(CHAT, json=b), bodies))
    admitted = [r for r in responses if r.status_code == 200]
    refused = [(b, r) for b, r in zip(bodies, responses, strict=True) if r.status_code == 429]
    assert len(admitted) + len(refused) == BURST, [r.text for r in responses]
    assert admitted and refused, [r.status_code for r in responses]
    for _, resp in refused:
        error = resp.json()["error"]
        assert error["code"] == "ttft_budget_exceeded", error
        found = re.search(r"Projected time to first token (\d+) ms exceeds the (\d+) ms budget "
                          r"by (\d+) ms", error["message"])
        assert found, error["message"]
        projected, budget, overrun = (int(x) for x in found.groups())
        assert budget == SMALL_BUDGET_MS and abs(projected - budget - overrun) <= 1
        retry = int(resp.headers["retry-after"])
        assert retry >= 1 and abs(retry - max(1.0, overrun / 1000)) <= 0.5 + 1e-3
        # not rounded: the overrun (to the millisecond, up), at least a second
        assert max(1000, overrun) <= int(resp.headers["retry-after-ms"]) <= max(1000, overrun + 1)
    for resp in admitted:
        assert resp.json()["usage"]["completion_tokens"] >= 1
    settled = small_pair.settled()["requests"]
    counts = settled["terminal"]
    assert counts["completed"] - before["completed"] == len(admitted)
    assert counts["refused"] - before["refused"] == len(refused)
    assert settled["held"] == 0
    body, _ = refused[-1]
    with small_pair.routed() as c:
        again = c.post(CHAT, json=body)
    assert again.status_code == 200, again.text
    assert int(again.headers["x-narwhal-predicted-ttft-ms"]) <= SMALL_BUDGET_MS


CLIENTS = 12  # more than vLLM's 8 sequences (``--max-num-seqs 8``) and Narwhal's 4 slots


def test_the_engines_sequence_cap_is_learned_from_outside(small_pair):
    """vLLM runs at most 8 sequences here; a prompt sent while it runs 8 waits in its
    queue for one to finish, not for the next step. Twelve clients in a closed loop keep
    it full; Narwhal's step model learns the cap from the steps that did and did not take
    in the prompt first in line, by how many sequences decoded then (nothing reads vLLM's
    settings), and sees the engine's own gauge say it holds requests waiting. Its intake,
    learned beside it, is vLLM's few milliseconds, not a step."""
    done = threading.Event()
    sent = itertools.count(1)

    def client(k: int) -> None:
        words = " ".join(f"narwhal{(k * 31 + j) % 97} tusk" for j in range(60))
        with small_pair.routed() as c:
            while not done.is_set() and (n := next(sent)) <= 1500:
                body = {"model": SERVED_MODEL, "max_tokens": 24,
                        "messages": [{"role": "user", "content": f"{n}: {words}"}]}
                assert c.post(CHAT, json=body).status_code in (200, 429)

    seen_full = [False]

    def learned() -> dict | None:
        steps = small_pair.engine_status()["step_model"]
        seen_full[0] = seen_full[0] or steps["saturated"]
        assert not any(f.done() for f in futures), steps  # all sent, or one failed
        return steps if steps["sequence_cap"] == 8 and seen_full[0] else None

    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(client, k) for k in range(CLIENTS)]
        try:
            steps = wait_for(learned, timeout=600)
        finally:
            done.set()
        for f in futures:
            f.result()
    assert 0 <= steps["intake_ms"] < 100, steps
    assert small_pair.settled()["requests"]["held"] == 0


def test_priorities_order_the_queue_and_shed_in_front_of_vllm(objectives_pair):
    """admission.objectives in front of real vLLM, one request at a time: behind a long
    prompt (a second of the small model's prefill) a request without an objective
    queues, then one naming the "interactive" objective (priority 10), which vLLM answers
    first; a "batch" one (priority -1) arriving meanwhile is refused 429
    ``request_shed`` rather than queued, and served once the engine is free."""
    p = objectives_pair
    interactive = {"x-gateway-inference-objective": "interactive"}
    batch = {"x-llm-d-inference-objective": "batch"}
    before = p.stack_counts()
    with ThreadPoolExecutor(3) as pool, p.routed() as c:
        first = pool.submit(c.post, CHAT, json=_long_body(0))
        wait_for(lambda: p.engine_status()["in_flight"] == 1)
        usual = pool.submit(c.post, CHAT, json=BODY)
        wait_for(lambda: p.status()["requests"]["queued"] == 1)
        urgent = pool.submit(c.post, CHAT, json=BODY, headers=interactive)
        wait_for(lambda: p.status()["requests"]["queued"] == 2)
        shed = c.post(CHAT, json=BODY, headers=batch)
        assert shed.status_code == 429 and shed.json()["error"]["code"] == "request_shed"
        assert shed.headers["retry-after"] == "1"
        assert p.status()["requests"]["queued"] == 2  # it did not join the queue
        done = list(as_completed([usual, urgent]))
        assert [f.result().status_code for f in done] == [200, 200]
        assert done == [urgent, usual]
        assert first.result().status_code == 200
        served = c.post(CHAT, json=BODY, headers=batch)
        assert served.status_code == 200, served.text
    counts = p.stack_counts()
    assert counts["rejected"] - before["rejected"] == 1
    assert counts["completed"] - before["completed"] == 4
