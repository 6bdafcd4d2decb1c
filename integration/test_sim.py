"""`narwhal sim` speaks vLLM's wire format and is deterministic per seed."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import orjson
import pytest

from narwhal import cli
from narwhal.launch import SimSpec, Stack

from .conftest import wait_for

MODEL = "narwhal-sim"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 5,
        "max_tokens": 6}


@pytest.fixture(scope="module")
def sim():
    stack = Stack(sims=[SimSpec("sim-direct")], model=MODEL).start_sims()
    yield f"http://127.0.0.1:{stack.sims[0].port}"
    stack.stop()


def sse(resp: httpx.Response) -> list[dict]:
    return [orjson.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_vllm_stream_shape(sim):
    body = BODY | {"stream": True, "stream_options": {"include_usage": True},
                   "return_token_ids": True}
    events = sse(httpx.post(f"{sim}/v1/chat/completions", json=body))
    assert events[0]["prompt_token_ids"] and events[0]["choices"][0]["delta"]["role"] == "assistant"
    tokens = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(tokens) == 6 and all(len(e["choices"][0]["token_ids"]) == 1 for e in tokens)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "stop_reason" in events[-2]["choices"][0]


def test_same_seed_same_output_streaming_or_not(sim):
    full = httpx.post(f"{sim}/v1/chat/completions", json=BODY).json()
    events = sse(httpx.post(f"{sim}/v1/chat/completions", json=BODY | {"stream": True}))
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert full["choices"][0]["message"]["content"] == text
    again = httpx.post(f"{sim}/v1/chat/completions", json=BODY).json()
    assert again["choices"] == full["choices"]
    other = httpx.post(f"{sim}/v1/chat/completions", json=BODY | {"seed": 6}).json()
    assert other["choices"][0]["message"]["content"] != text


def test_models_health_metrics(sim):
    assert httpx.get(f"{sim}/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(f"{sim}/health").status_code == 200
    metrics = httpx.get(f"{sim}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        assert name in metrics
    # vLLM's cache configuration info gauge, as Narwhal's telemetry parses it.
    from narwhal.server.telemetry import parse_vllm_metrics

    assert parse_vllm_metrics(metrics)["kv_capacity_tokens"] == 16 * 65536


def test_unknown_fault_is_refused(sim):
    resp = httpx.post(f"{sim}/v1/chat/completions", json=BODY, headers={"x-sim-fault": "nope"})
    assert resp.status_code == 400


def test_abrupt_close_cuts_the_stream(sim):
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{sim}/v1/chat/completions", json=BODY | {"stream": True},
                   headers={"x-sim-fault": "abrupt-close"})


def _metric(base: str, name: str) -> float:
    """A series of the simulator's ``/metrics`` by its whole name (vLLM's carry labels,
    the simulator's own none)."""
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}")


def test_metrics_count_prefix_cache_hits(sim):
    """Two requests with one long shared prefix: the second's full blocks are hits."""
    system = {"role": "system", "content": "You are a narwhal. " * 40}  # ~190 tokens
    queries = _metric(sim, "vllm:prefix_cache_queries_total")
    hits = _metric(sim, "vllm:prefix_cache_hits_total")
    for question in ("first?", "second?"):
        body = {"model": MODEL, "max_tokens": 2,
                "messages": [system, {"role": "user", "content": question}]}
        assert httpx.post(f"{sim}/v1/chat/completions", json=body).status_code == 200
    asked = _metric(sim, "vllm:prefix_cache_queries_total") - queries
    got = _metric(sim, "vllm:prefix_cache_hits_total") - hits
    assert asked > 380
    assert 160 <= got < asked / 2  # the shared system prompt's full blocks, once


def test_waiting_and_running_tell_the_truth():
    """--max-num-seqs 1: a long request runs, the next one waits in the engine; the
    client that leaves has its sequence aborted, and the waiting one runs."""
    stack = Stack(sims=[SimSpec("sim-seqs", args=["--max-num-seqs", "1", "--tpot-ms", "50"])],
                  model=MODEL).start_sims()
    base = f"http://127.0.0.1:{stack.sims[0].port}"
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with httpx.Client(timeout=60) as c, c.stream(
                    "POST", f"{base}/v1/chat/completions",
                    json=BODY | {"stream": True, "max_tokens": 2000}) as long:
                lines = long.iter_lines()  # held: a dropped iterator may close the stream
                next(lines)  # it is in the engine (and runs for 100 s)
                behind = pool.submit(httpx.post, f"{base}/v1/chat/completions", json=BODY,
                                     timeout=60)
                polls = 0
                while _metric(base, "vllm:num_requests_waiting") != 1.0:
                    polls += 1
                    assert polls < 1000 and not behind.done()
                assert _metric(base, "vllm:num_requests_running") == 1.0
            assert behind.result().status_code == 200  # ran once the long one was aborted
        assert _metric(base, "vllm:num_requests_running") == 0.0
        assert _metric(base, "vllm:kv_cache_usage_perc") == 0.0
    finally:
        stack.stop()


def test_speed_knob_is_validated(sim):
    assert httpx.post(f"{sim}/sim/speed", json={"speed": 0.5}).json() == {"speed": 0.5}
    assert httpx.post(f"{sim}/sim/speed", json={"speed": 1}).json() == {"speed": 1.0}
    bad = httpx.post(f"{sim}/sim/speed", json={"speed": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speed"


def test_a_held_engine_accepts_requests_and_runs_no_step_until_released(sim):
    bad = httpx.post(f"{sim}/sim/hold", json={"hold": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "hold"
    assert httpx.post(f"{sim}/sim/hold", json={"hold": True}).json() == {"hold": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, f"{sim}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        wait_for(lambda: _metric(sim, "vllm:num_requests_waiting") == 1.0)
        assert _metric(sim, "vllm:num_requests_running") == 0.0  # not even scheduled
        assert not fut.done()
        assert httpx.post(f"{sim}/sim/hold", json={"hold": False}).json() == {"hold": False}
        resp = fut.result()
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


def test_a_request_reaches_the_scheduler_after_its_intake():
    """As in vLLM, a request is taken in (read, rendered, tokenized) before the scheduler
    sees it: on a held engine it shows as waiting no sooner than its intake (a sleep never
    returns early, so the bound cannot flake), and the flags refuse a negative intake."""
    intake_s = 0.4 + 2000 * 1e-6  # --intake-ms 400, 1 us a token of a ~2,000-token prompt
    stack = Stack(sims=[SimSpec("sim-intake", args=["--intake-ms", "400"])],
                  model=MODEL).start_sims()
    base = f"http://127.0.0.1:{stack.sims[0].port}"
    try:
        assert httpx.post(f"{base}/sim/hold", json={"hold": True}).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = time.monotonic()
            fut = pool.submit(httpx.post, f"{base}/v1/chat/completions", timeout=30, json={
                "model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": "abcd" * 2000}]})
            wait_for(lambda: _metric(base, "vllm:num_requests_waiting") == 1.0)
            assert time.monotonic() - sent >= intake_s
            httpx.post(f"{base}/sim/hold", json={"hold": False})
            assert fut.result().status_code == 200
    finally:
        stack.stop()
    for flag in ("--intake-ms", "--intake-us-per-token"):
        assert cli.main(["sim", flag, "-1"]) == 2


def test_busy_seconds_count_the_steps_as_run():
    """``narwhal_sim_busy_seconds_total`` is the steps' cost as the engine ran them, and
    ``narwhal_sim_full_step_seconds_total`` the part in steps that used their whole token
    budget: one request on an engine whose every step takes 7 ms (times --time-scale 2)
    with a 16-token budget runs its prompt in 16-token chunks (full steps; the last chunk
    also samples the first token), then a step a token (not full); nothing while idle."""
    stack = Stack(sims=[SimSpec("sim-busy", args=["--tpot-ms", "7", "--prefill-tps", "0",
                                                  "--ctx-ms-per-ktok", "0",
                                                  "--max-num-batched-tokens", "16",
                                                  "--time-scale", "2", "--intake-ms", "0"])],
                  model=MODEL).start_sims()
    base = f"http://127.0.0.1:{stack.sims[0].port}"
    try:
        assert _metric(base, "narwhal_sim_busy_seconds_total") == 0.0
        resp = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 5,
            "messages": [{"role": "user", "content": "a narwhal's tusk " * 10}]})
        assert resp.status_code == 200
        usage = resp.json()["usage"]
        prompt = usage["prompt_tokens"]
        assert usage["completion_tokens"] == 5 and prompt > 32
        step_s = 0.007 * 2
        assert _metric(base, "narwhal_sim_busy_seconds_total") == pytest.approx(
            (-(-prompt // 16) + 4) * step_s)
        assert _metric(base, "narwhal_sim_full_step_seconds_total") == pytest.approx(
            prompt // 16 * step_s)
    finally:
        stack.stop()


def test_usage_reports_the_prompts_cache_hit_with_vllms_flag():
    """``--enable-prompt-tokens-details``: usage carries ``prompt_tokens_details`` as vLLM
    0.32 writes it, streaming or not; the second of two requests sharing a long prefix
    reports the prefix's full blocks cached. Without the flag the field is null."""
    stack = Stack(sims=[SimSpec("sim-details", args=["--enable-prompt-tokens-details"])],
                  model=MODEL).start_sims()
    try:
        url = f"http://127.0.0.1:{stack.sims[0].port}/v1/chat/completions"
        system = {"role": "system", "content": "You are a narwhal. " * 40}  # ~190 tokens
        details = []
        for question, stream in (("first?", False), ("second?", True), ("third?", False)):
            body = {"model": MODEL, "max_tokens": 2, "stream": stream,
                    "messages": [system, {"role": "user", "content": question}]}
            if stream:
                body["stream_options"] = {"include_usage": True}
            resp = httpx.post(url, json=body)
            assert resp.status_code == 200
            usage = sse(resp)[-1]["usage"] if stream else resp.json()["usage"]
            details.append((usage["prompt_tokens"], usage["prompt_tokens_details"]))
        (prompt, first), (_, second), (_, third) = details
        assert first == {"cached_tokens": 0, "created_cache_tokens": prompt // 16 * 16,
                         "multimodal_tokens": None}
        assert second["cached_tokens"] == third["cached_tokens"] >= 160
        assert second["cached_tokens"] % 16 == 0
    finally:
        stack.stop()


def test_without_vllms_flag_usage_has_no_prompt_details(sim):
    resp = httpx.post(f"{sim}/v1/chat/completions", json=BODY)
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"] is None
