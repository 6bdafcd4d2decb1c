"""`narwhal sim` speaks vLLM's wire format and is deterministic per seed."""

from __future__ import annotations

import httpx
import orjson
import pytest

from narwhal.launch import SimSpec, Stack

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


def test_unknown_fault_is_refused(sim):
    resp = httpx.post(f"{sim}/v1/chat/completions", json=BODY, headers={"x-sim-fault": "nope"})
    assert resp.status_code == 400


def test_abrupt_close_cuts_the_stream(sim):
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{sim}/v1/chat/completions", json=BODY | {"stream": True},
                   headers={"x-sim-fault": "abrupt-close"})
