"""TPOT scoring and output-length learning through a real Envoy."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from narwhal.launch import SimSpec

from .conftest import MODEL, _stack, wait_for
from .test_profiling import engine, status, wait_engine


@pytest.fixture(scope="module")
def decoders():
    yield from _stack([SimSpec("quick", args=["--tpot-ms", "5", "--natural-output", "20"]),
                       SimSpec("sluggish", args=["--tpot-ms", "60", "--num-gpu-blocks", "1000",
                                                  "--max-model-len", "16000"])])


def chat(stack, headers: dict[str, str] | None = None, system: str = "You are terse.",
         max_tokens: int = 64) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions", timeout=60, headers=headers or {},
                      json={"model": MODEL, "max_tokens": max_tokens, "stream": True,
                            "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": "hello"}]})


def test_tpot_budget_places_on_engines_that_meet_it_and_refuses_otherwise(decoders):
    for name in ("quick", "sluggish"):
        wait_engine(decoders, name, lambda e: e["profiled"])
    assert engine(decoders, "sluggish")["tpot_ms"] > 30 > engine(decoders, "quick")["tpot_ms"]
    before = engine(decoders, "sluggish")["dispatched"]
    for _ in range(5):
        assert chat(decoders, {"x-slo-tpot-ms": "30"}).status_code == 200
    assert engine(decoders, "sluggish")["dispatched"] == before
    refused = chat(decoders, {"x-slo-tpot-ms": "1"})
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "tpot_budget_exceeded"
    assert refused.headers["retry-after"] == "1"
    bad = chat(decoders, {"x-slo-tpot-ms": "fast"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-slo-tpot-ms"


def test_output_length_is_learned_from_identified_output(decoders):
    wait_engine(decoders, "quick", lambda e: e["profiled"])
    predicted, actual = [], []
    for _ in range(12):
        resp = chat(decoders, {"x-slo-tpot-ms": "30"}, system="You answer in twenty words.",
                    max_tokens=512)
        assert resp.status_code == 200
        predicted.append(int(resp.headers["x-narwhal-predicted-output-tokens"]))
        actual.append(sum(1 for line in resp.text.splitlines()
                          if line.startswith("data: {") and '"content":" ' in line))
    # the first guess came from other applications' answers (the route's average)
    late = [abs(p - a) / a for p, a in zip(predicted[6:], actual[6:], strict=True)]
    assert sum(late) / len(late) < 0.6  # lognormal outputs: the mean is the best guess
    assert status(decoders)["output_length_error"]["samples"] >= 12


def test_the_prefix_index_is_bounded_by_the_engines_reported_cache(decoders):
    engines = {e["name"]: e for e in status(decoders)["engines"]}
    small, large = engines["sluggish"], engines["quick"]
    assert small["kv_capacity_tokens"] == 16 * 1000 and large["kv_capacity_tokens"] == 16 * 65536
    # 16000 tokens hold a few hundred 64-byte prompt blocks, not the configured 65536.
    assert 100 < small["prefix_index_capacity"] < 65536 == large["prefix_index_capacity"]


def _margin_samples(e: dict) -> int:
    """The ratios an engine's admission margins hold: of requests placed on it idle, and
    of the others (which, one after another, depends on when its report last said idle)."""
    return sum(o["samples"] for o in e["calibration_octaves"] + e["idle_calibration_octaves"])


def test_admission_margins_are_learned_per_size_of_projection(decoders):
    """Each first token of an admitted request is one ratio in the octave of its
    projection (long prompts: projections under 10 ms teach nothing); /status shows them."""
    wait_engine(decoders, "quick", lambda e: e["profiled"])
    # Two long prompts first: the profile's probes are short, and on this engine (free
    # prefill, 5 ms steps) a model that has seen only short prompts may project a long
    # one under 10 ms, which teaches calibration nothing.
    for i in range(2):
        warm = f"warm {i} You are terse. " + "narwhal tusk ocean " * 1500
        assert chat(decoders, {"x-slo-tpot-ms": "30"}, system=warm, max_tokens=2
                    ).status_code == 200
    seen = _margin_samples(engine(decoders, "quick"))
    for i in range(4):
        long = f"{i} You are terse. " + "narwhal tusk ocean " * 1500
        resp = chat(decoders, {"x-slo-tpot-ms": "30"}, system=long, max_tokens=2)
        assert resp.status_code == 200, resp.text
        assert int(resp.headers["x-narwhal-predicted-ttft-ms"]) >= 10, resp.headers
    after = engine(decoders, "quick")
    assert _margin_samples(after) == seen + 4, after
    assert all(o["upto_ms"] > 0
               for o in after["calibration_octaves"] + after["idle_calibration_octaves"])
    assert after["calibration"] >= 1.0 and after["idle_calibration"] >= 1.0


@pytest.fixture(scope="module")
def near_far():
    """Two engines, one 20x faster at prefill: placement prefers it by projection."""
    yield from _stack([SimSpec("near", args=["--prefill-tps", "20000", "--tpot-ms", "5"]),
                       SimSpec("far", args=["--prefill-tps", "1000", "--tpot-ms", "5"])])


def test_an_engine_takes_unverified_backlog_only_up_to_half_again_what_it_verified(near_far):
    """The verified-backlog filter through Envoy: while the faster engine holds its first
    tokens (the simulator's gate), it takes requests only while their prefill work stays
    within 1.5 times the largest backlog it has served a first token behind (its
    profile's);
    the next goes to the slower engine, though projected slower. Once the first tokens
    come, what was verified grows."""
    for name in ("near", "far"):
        wait_engine(near_far, name, lambda e: e["profiled"])
    sim = f"http://127.0.0.1:{next(s.port for s in near_far.sims if s.name == 'near')}"
    verified = engine(near_far, "near")["verified_work"]
    assert verified > 0 and engine(near_far, "far")["verified_work"] > 0
    assert httpx.post(f"{sim}/sim/hold", json={"hold": True}).status_code == 200
    placed: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = []
        try:
            while "far" not in placed:
                assert len(placed) < 3, placed  # near has 4 prefill slots: not what stops it
                before = {n: engine(near_far, n)["dispatched"] for n in ("near", "far")}
                # distinct words first (no shared prefix); ~0.65x the verified backlog in
                # the router's estimate (4 bytes a token)
                prompt = f"{len(placed)} request " + "tusk " * int(0.65 * verified * 4 / 5)
                futures.append(pool.submit(chat, near_far, {"x-slo-ttft-ms": "60000"},
                                           system=prompt, max_tokens=2))
                now = wait_for(lambda b=before: next(
                    ({"name": n} | engine(near_far, n) for n in ("near", "far")
                     if engine(near_far, n)["dispatched"] > b[n]), None))
                placed.append(now["name"])
                near = engine(near_far, "near")
                assert near["prefill_work"] <= 1.5 * verified, (placed, near)
            work = engine(near_far, "near")["prefill_work"] / placed.count("near")
            assert placed == ["near", "near", "far"], (placed, work, verified)
            assert 3 * work > 1.5 * verified  # one more would have passed 1.5x the verified
        finally:
            httpx.post(f"{sim}/sim/hold", json={"hold": False})
        for f in futures:
            resp = f.result()
            assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n"), resp.text
    # the second request's first token came behind both requests' work
    assert engine(near_far, "near")["verified_work"] >= 2 * work > verified


@pytest.fixture(scope="module")
def solo():
    yield from _stack([SimSpec("solo", args=["--tpot-ms", "40"])])


def test_the_step_model_learns_the_engines_steps_from_relayed_tokens(solo):
    """Through Envoy: while one long stream decodes (a token every step), prompts sent
    one after another are each computed in a step between its tokens; the engine's step
    model learns those steps' length from the tokens Narwhal relayed, projects the later
    prompts in whole steps, and each first token judges the projections (/status)."""
    wait_engine(solo, "solo", lambda e: e["profiled"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(chat, solo, None, "You write at length.", 200)
        wait_engine(solo, "solo", lambda e: e["decode"] == 1)  # the long one decodes
        for _ in range(8):
            assert chat(solo, max_tokens=2).status_code == 200
        mid = engine(solo, "solo")
        assert long.result().status_code == 200
    model = mid["step_model"]
    assert model["steps"] >= 4 and model["judged"] >= 8, model
    assert model["step_fixed_ms"] + model["step_us_per_token"] > 0
    assert model["budget_tokens"] in (1024, 2048, 4096, 8192, 16384)
    assert mid["decode"] == 1  # the long stream still held the engine's steps meanwhile


def _engine_hits(stack, name: str) -> tuple[float, float]:
    """The engine's own prefix-cache counters (queried, hit tokens), from its /metrics."""
    text = httpx.get(f"{engine(stack, name)['url']}/metrics", timeout=5).text
    values = {}
    for line in text.splitlines():
        for key in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(key):
                values[key] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


def test_a_conversations_next_turn_is_expected_cached_with_the_reply_it_carries(solo):
    """Engines cache a reply's blocks as well as the prompt's (vLLM v1), so the next turn
    of a conversation hits both where the reply was generated. Through Envoy, streaming
    and not: Narwhal's index expects each turn's hit as the engine then reports it."""
    wait_engine(solo, "solo", lambda e: e["profiled"])
    llm = openai.OpenAI(base_url=f"{solo.url}/v1", api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "system", "content": "You are a careful narwhal expert. " * 30},
                {"role": "user", "content": "Tell me everything about narwhal tusks. " * 10}]
    carried = 0.0  # the earlier turns' prompt and half the reply, in tokens
    for turn, stream in enumerate((True, False, True)):
        before, (queried, hits) = engine(solo, "solo"), _engine_hits(solo, "solo")
        if stream:
            chunks = list(llm.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=90, stream=True,
                stream_options={"include_usage": True}))
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            prompt = chunks[-1].usage.prompt_tokens
        else:
            resp = llm.chat.completions.create(model=MODEL, messages=messages, max_tokens=90)
            reply, prompt = resp.choices[0].message.content or "", resp.usage.prompt_tokens
        after, (queried2, hits2) = engine(solo, "solo"), _engine_hits(solo, "solo")
        assert queried2 - queried == prompt
        expected = after["index_cached_tokens"] - before["index_cached_tokens"]
        hit = hits2 - hits
        if turn:
            # The engine hit the earlier turns' prompts *and* replies, and Narwhal knew.
            assert hit > carried, (hit, carried)
            assert abs(expected - hit) < 0.1 * hit, (expected, hit)
        carried = prompt + 0.5 * len(reply) / 4
        assert len(reply) > 350
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"And then? ({turn})"}]
