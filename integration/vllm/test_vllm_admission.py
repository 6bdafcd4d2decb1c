"""Predictive admission in front of real vLLM: the engine is learned from outside (its
profile's probes, identified by token IDs), and the seed's predictive rows hold on what
was learned.

The row "projected total over the budget although the prompt alone fits" needs a backlog
held on the engine while the request arrives; a CPU vLLM prefills a prompt of this
size in milliseconds and cannot be held from outside, so that row is proven through
Envoy against the simulator's gate (``integration/test_admission.py``).
"""

from __future__ import annotations

import openai
import pytest

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
    error = resp.json()["error"]
    assert error["code"] == "prompt_exceeds_ttft_budget" and error["type"] == "rate_limit_error"
    assert tools_pair.stack_counts()["refused"] == before["refused"] + 1
    client = openai.OpenAI(base_url=f"{tools_pair.stack.url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=SERVED_MODEL, messages=MSGS, max_tokens=4,
                                       extra_headers={"x-slo-ttft-ms": "0.001"})
    assert info.value.code == "prompt_exceeds_ttft_budget"


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
