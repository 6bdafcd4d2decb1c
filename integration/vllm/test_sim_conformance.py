"""`narwhal sim` against real vLLM 0.32: the same requests to both, the wire structure
compared, so that the simulator cannot drift from the engine it stands in for.

Compared: which keys events, choices, deltas, tool-call fragments, usage and errors
have and where; finish reasons; statuses; ``/v1/models``; the ``/metrics`` names and
labels Narwhal reads. Not compared: values that depend on weights (text, token IDs,
logprob values, how many tokens a random model spends before a tool call).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal.launch import SimSpec, Stack

from .engine import SERVED_MODEL
from .model import MAX_MODEL_LEN
from .test_vllm_requests import CHAT, CLOCK, MSGS, TEXT, WEATHER
from .wire import shapes, sse

REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("chat", CHAT, {"messages": MSGS, "max_tokens": 6}),
    ("chat-ids", CHAT, {"messages": MSGS, "max_tokens": 6, "return_token_ids": True}),
    ("chat-logprobs", CHAT, {"messages": MSGS, "max_tokens": 4, "logprobs": True,
                             "top_logprobs": 2}),
    ("text", TEXT, {"prompt": "The narwhal", "max_tokens": 6}),
    ("text-ids", TEXT, {"prompt": "The narwhal", "max_tokens": 6, "return_token_ids": True}),
    ("text-logprobs", TEXT, {"prompt": "The narwhal", "max_tokens": 4, "logprobs": 2}),
    ("text-echo", TEXT, {"prompt": "The narwhal", "max_tokens": 4, "echo": True}),
    # a batch of one prompt: the prompt itself, echoed back
    ("text-batch-of-one", TEXT, {"prompt": ["The narwhal"], "max_tokens": 4, "echo": True}),
    ("text-ids-batch-of-one", TEXT, {"prompt": [[12, 40, 77]], "max_tokens": 4,
                                     "return_token_ids": True}),
    ("tools-required", CHAT, {"messages": MSGS, "max_tokens": 120, "seed": 1,
                              "tools": [WEATHER, CLOCK], "tool_choice": "required"}),
    ("tools-required-ids", CHAT, {"messages": MSGS, "max_tokens": 120, "seed": 2,
                                  "tools": [WEATHER, CLOCK], "tool_choice": "required",
                                  "return_token_ids": True}),
]
REFUSALS: list[tuple[str, dict[str, Any]]] = [
    ("max-tokens-over-context", {"max_tokens": 5000}),
    ("negative-temperature", {"max_tokens": 2, "temperature": -1}),
    ("stream-interval-zero", {"max_tokens": 2, "stream_interval": 0}),
    ("seed-past-int64", {"max_tokens": 2, "seed": 2**64}),
    ("seed-fractional", {"max_tokens": 2, "seed": 1.5}),
    ("temperature-not-a-number", {"max_tokens": 2, "temperature": "hot"}),
    ("top-p-over-one", {"max_tokens": 2, "top_p": 2}),
    ("top-k-negative", {"max_tokens": 2, "top_k": -5}),
    ("stop-not-a-string", {"max_tokens": 2, "stop": 5}),
    ("frequency-penalty-over-two", {"max_tokens": 2, "frequency_penalty": 5}),
    ("presence-penalty-under-minus-two", {"max_tokens": 2, "presence_penalty": -3}),
    ("user-not-a-string", {"max_tokens": 2, "user": 5}),
    ("request-id-not-a-string", {"max_tokens": 2, "request_id": 5}),
    ("min-tokens-over-max", {"max_tokens": 2, "min_tokens": 5}),
    ("text-part-not-a-string", {"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    ("part-not-an-object", {"max_tokens": 2, "messages": [{"role": "user", "content": [5]}]}),
    ("image-on-a-text-model", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}),
    ("user-content-null", {"max_tokens": 2, "messages": [{"role": "user", "content": None}]}),
]
TEXT_REFUSALS: list[tuple[str, dict[str, Any]]] = [
    ("empty-prompt", {"prompt": ""}),
    ("no-prompts", {"prompt": []}),
    ("negative-token-id", {"prompt": [-1]}),
    ("suffix", {"prompt": "The narwhal", "suffix": "x"}),
]
# Accepted by both: integral floats for integer fields (pydantic's lax mode).
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("max-tokens-integral-float", {"max_tokens": 2.0}),
    ("empty-stream-options", {"max_tokens": 2, "stream_options": {}}),
]


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, str]]:
    stack = Stack(sims=[SimSpec("sim-tools", args=["--max-model-len", str(MAX_MODEL_LEN)]),
                        SimSpec("sim-reasoning", args=["--max-model-len", str(MAX_MODEL_LEN),
                                                       "--reasoning", "reasoning"])],
                  model=SERVED_MODEL).start_sims()
    try:
        yield {"tools": f"http://127.0.0.1:{stack.sims[0].port}",
               "reasoning": f"http://127.0.0.1:{stack.sims[1].port}"}
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def engines(vllm_servers, sims) -> dict[str, tuple[str, str]]:
    """variant -> (vLLM URL, simulator URL)"""
    return {name: (vllm_servers[name].url, sims[name]) for name in ("tools", "reasoning")}


def _both(engines, variant: str, path: str, body: dict[str, Any],
          stream: bool) -> tuple[tuple[int, list[Any]], tuple[int, list[Any]]]:
    out = []
    for url in engines[variant]:
        with httpx.Client(base_url=url, timeout=120) as c:
            full = {"model": SERVED_MODEL} | body
            if stream:
                out.append(sse(c, path, full | {"stream": True}))
            else:
                resp = c.post(path, json=full)
                out.append((resp.status_code, [resp.json()]))
    return out[0], out[1]


def _deltas(events: list[Any]) -> set[frozenset[str]]:
    return {frozenset(ch["delta"]) for e in events if isinstance(e, dict)
            for ch in e.get("choices") or () if "delta" in ch}


def _fragments(events: list[Any]) -> set[tuple[frozenset[str], frozenset[str]]]:
    return {(frozenset(tc), frozenset(tc.get("function") or {}))
            for e in events if isinstance(e, dict) for ch in e.get("choices") or ()
            for tc in (ch.get("delta") or {}).get("tool_calls") or ()}


def _finishes(events: list[Any]) -> list[str]:
    return [ch["finish_reason"] for e in events if isinstance(e, dict)
            for ch in e.get("choices") or () if ch.get("finish_reason")]


def _usage_keys(events: list[Any]) -> set[frozenset[str]]:
    return {frozenset(e) | frozenset(f"usage.{k}" for k in e["usage"])
            for e in events if isinstance(e, dict) and e.get("usage")}


def _keys(obj: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON value (list items merged), for non-streaming shapes."""
    out: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(prefix + k)
            out |= _keys(v, prefix + k + ".")
    elif isinstance(obj, list):
        for item in obj:
            out |= _keys(item, prefix + "[].")
    return out


CONTENT_FREE = re.compile(r"logprobs\.(content|top_logprobs)\.|logprobs\.top_logprobs\.\[\]\.")


@pytest.mark.parametrize("name,path,body", REQUESTS, ids=[r[0] for r in REQUESTS])
@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
def test_stream_structure(engines, name, path, body, usage):
    body = body | ({"stream_options": {"include_usage": True}} if usage else {})
    (vs, vllm), (ss, sim) = _both(engines, "tools", path, body, stream=True)
    assert vs == ss == 200
    assert shapes(sim) == shapes(vllm)
    missing = _deltas(vllm) - _deltas(sim)
    if not name.startswith("tools"):
        # A random model may sample a markup token the tool parser swallows (``delta: {}``)
        # in plain chat; the simulator does that only around tool calls, checked there.
        missing.discard(frozenset())
    assert not missing, "the simulator lacks a delta shape vLLM sends"
    assert _fragments(sim) == _fragments(vllm)
    assert _finishes(sim) == _finishes(vllm)
    assert _usage_keys(sim) == _usage_keys(vllm)
    assert vllm[-1] == sim[-1] == "[DONE]"


@pytest.mark.parametrize("name,path,body", REQUESTS, ids=[r[0] for r in REQUESTS])
def test_non_streaming_structure(engines, name, path, body):
    (vs, vllm), (ss, sim) = _both(engines, "tools", path, body, stream=False)
    assert vs == ss == 200
    # Top-level logprob dicts are keyed by token text (weights), so compare above them.
    vkeys = {k for k in _keys(vllm[0]) if not CONTENT_FREE.search(k) or k.endswith("content")}
    skeys = {k for k in _keys(sim[0]) if not CONTENT_FREE.search(k) or k.endswith("content")}
    vkeys -= {"choices.[].routed_experts", "kv_transfer_params", "ec_transfer_params", "metrics"}
    assert skeys == vkeys
    assert _finishes([{"choices": sim[0]["choices"]}]) == _finishes([{"choices": vllm[0]["choices"]}])


@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
def test_reasoning_structure(engines, usage):
    body = {"messages": MSGS, "max_tokens": 8} | (
        {"stream_options": {"include_usage": True}} if usage else {})
    (vs, vllm), (ss, sim) = _both(engines, "reasoning", CHAT, body, stream=True)
    assert vs == ss == 200
    assert shapes(sim) == shapes(vllm)
    assert {frozenset({"reasoning"})} <= _deltas(vllm) & _deltas(sim)
    assert _usage_keys(sim) == _usage_keys(vllm)


def test_reasoning_hidden_structure(engines):
    body = {"messages": MSGS, "max_tokens": 8, "include_reasoning": False,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    (_, vllm), (_, sim) = _both(engines, "reasoning", CHAT, body, stream=True)
    for events in (vllm, sim):
        assert all(ch.get("token_ids") is None for e in events if isinstance(e, dict)
                   for ch in e.get("choices") or ())
        assert not any("reasoning" in d and len(d) == 1 for d in _deltas(events))


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_logprobs_limit_refusal(engines, stream):
    """vLLM refuses top_logprobs > 20 inside an opened stream, or with a 400."""
    body = {"messages": MSGS, "max_tokens": 2, "logprobs": True, "top_logprobs": 50}
    (vs, vllm), (ss, sim) = _both(engines, "tools", CHAT, body, stream=stream)
    assert vs == ss == (200 if stream else 400)
    assert len(sim) == len(vllm)
    assert set(sim[0]["error"]) == set(vllm[0]["error"])
    assert sim[0]["error"]["param"] == vllm[0]["error"]["param"]
    assert sim[0]["error"]["code"] == vllm[0]["error"]["code"] == 400


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_out_of_vocabulary_token_refusal(engines, stream):
    """vLLM refuses a token-ID prompt past its vocabulary inside an opened stream, or with a
    400 (both vocabularies are far below this ID)."""
    body = {"prompt": [5, 10**9], "max_tokens": 2}
    (vs, vllm), (ss, sim) = _both(engines, "tools", TEXT, body, stream=stream)
    assert vs == ss == (200 if stream else 400)
    assert sim == vllm  # the envelope, and [DONE] after it in a stream


@pytest.mark.parametrize("name,extra", REFUSALS, ids=[r[0] for r in REFUSALS])
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_refusals_before_the_stream(engines, name, extra, stream):
    (vs, vllm), (ss, sim) = _both(engines, "tools", CHAT, {"messages": MSGS} | extra, stream)
    assert vs == ss == 400
    assert set(sim[0]["error"]) == set(vllm[0]["error"])
    assert (sim[0]["error"]["param"], sim[0]["error"]["type"]) == (
        vllm[0]["error"]["param"], vllm[0]["error"]["type"])


@pytest.mark.parametrize("name,extra", TEXT_REFUSALS, ids=[r[0] for r in TEXT_REFUSALS])
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_text_refusals_before_the_stream(engines, name, extra, stream):
    (vs, vllm), (ss, sim) = _both(engines, "tools", TEXT, {"max_tokens": 2} | extra, stream)
    assert vs == ss == 400
    assert (sim[0]["error"]["param"], sim[0]["error"]["type"]) == (
        vllm[0]["error"]["param"], vllm[0]["error"]["type"])


BODY_REFUSALS: list[tuple[str, dict[str, str], bytes]] = [
    ("text-plain", {"content-type": "text/plain"}, b'{"messages": []}'),
    ("no-content-type", {}, b'{"messages": []}'),
    ("not-json", {"content-type": "application/json"}, b"{nope"),
    ("not-an-object", {"content-type": "application/json"}, b"[1, 2]"),
    ("empty", {"content-type": "application/json"}, b""),
    ("not-utf-8", {"content-type": "application/json"}, b'{"model": "\xf8"}'),
]


@pytest.mark.parametrize("name,headers,raw", BODY_REFUSALS, ids=[r[0] for r in BODY_REFUSALS])
def test_bodies_vllm_cannot_read_are_refused_alike(engines, name, headers, raw):
    answers = []
    for url in engines["tools"]:
        with httpx.Client(base_url=url, timeout=60) as c:
            resp = c.post(CHAT, content=raw, headers=headers)
            answers.append((resp.status_code, resp.json()))
    (vs, vllm), (ss, sim) = answers
    assert vs == ss == 400
    if "error" in vllm:
        assert (sim["error"]["param"], sim["error"]["type"]) == (
            vllm["error"]["param"], vllm["error"]["type"])
    else:  # FastAPI's own answer, before vLLM's handlers
        assert sim == vllm


def test_stream_options_without_a_stream_are_refused(engines):
    (vs, vllm), (ss, sim) = _both(engines, "tools", CHAT, {
        "messages": MSGS, "max_tokens": 2, "stream_options": {"include_usage": True}}, False)
    assert vs == ss == 400
    assert (sim[0]["error"]["param"], sim[0]["error"]["type"]) == (
        vllm[0]["error"]["param"], vllm[0]["error"]["type"]) == ("stream_options",
                                                                 "BadRequestError")


@pytest.mark.parametrize("name,extra", ACCEPTED, ids=[r[0] for r in ACCEPTED])
def test_lax_values_are_accepted(engines, name, extra):
    (vs, _), (ss, _) = _both(engines, "tools", CHAT, {"messages": MSGS} | extra, False)
    assert vs == ss == 200


ANSWER_IDS: list[tuple[str, str, dict[str, Any], dict[str, str], str | None]] = [
    ("chat-header", CHAT, {"messages": MSGS}, {"x-request-id": "from-header"},
     "chatcmpl-from-header"),
    ("text-header", TEXT, {"prompt": "The narwhal"}, {"x-request-id": "from-header"},
     "cmpl-from-header"),
    ("chat-body", CHAT, {"messages": MSGS, "request_id": "from-body"}, {},
     "chatcmpl-from-body"),
    ("header-over-body", CHAT, {"messages": MSGS, "request_id": "from-body"},
     {"x-request-id": "from-header"}, "chatcmpl-from-header"),
    ("chat-neither", CHAT, {"messages": MSGS}, {}, None),
]


@pytest.mark.parametrize("name,path,body,headers,expected", ANSWER_IDS,
                         ids=[r[0] for r in ANSWER_IDS])
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_answer_ids(engines, name, path, body, headers, expected, stream):
    """Both engines name an answer after the request's ``X-Request-Id`` (which Envoy sets
    on every request it proxies), else its body's ``request_id``; else after nothing the
    caller chose, so two identical requests get two names."""
    for url in engines["tools"]:
        ids = []
        with httpx.Client(base_url=url, timeout=120) as c:
            full = {"model": SERVED_MODEL, "max_tokens": 2, "seed": 3} | body
            for _ in range(2):
                if stream:
                    status, events = sse(c, path, full | {"stream": True}, headers=headers)
                    assert {e["id"] for e in events if isinstance(e, dict)} == {events[0]["id"]}
                else:
                    resp = c.post(path, json=full, headers=headers)
                    status, events = resp.status_code, [resp.json()]
                assert status == 200, (url, events)
                ids.append(events[0]["id"])
        if expected is not None:
            assert ids == [expected, expected], url
        else:
            prefix = "chatcmpl-" if path == CHAT else "cmpl-"
            assert ids[0].startswith(prefix) and ids[0] != ids[1], (url, ids)


def test_unknown_model(engines):
    (vs, vllm), (ss, sim) = _both(engines, "tools", CHAT, {"messages": MSGS, "model": "nope"},
                                  stream=False)
    assert vs == ss == 404
    assert (sim[0]["error"]["type"], sim[0]["error"]["param"]) == (
        vllm[0]["error"]["type"], vllm[0]["error"]["param"])


def test_models_route(engines):
    vllm, sim = (httpx.get(f"{url}/v1/models", timeout=10).json() for url in engines["tools"])
    assert set(sim) == set(vllm)
    assert set(sim["data"][0]) == set(vllm["data"][0])
    assert set(sim["data"][0]["permission"][0]) == set(vllm["data"][0]["permission"][0])
    assert sim["data"][0]["max_model_len"] == vllm["data"][0]["max_model_len"] == MAX_MODEL_LEN


METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
           "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def _exposition(url: str) -> dict[str, tuple[str, str, frozenset[str], str]]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for name in METRICS:
        kind = re.search(rf"^# TYPE {re.escape(name)} (\w+)$", text, re.M)
        doc = re.search(rf"^# HELP {re.escape(name)} (.+)$", text, re.M)
        sample = re.search(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M)
        assert kind and doc and sample, name
        labels = frozenset(part.split("=")[0] for part in sample.group(1).split(","))
        value = sample.group(2)
        float(value)
        out[name] = (kind.group(1), doc.group(1), labels, "float" if "." in value else "int")
    return out


def test_metrics_narwhal_reads(engines):
    vllm, sim = (_exposition(url) for url in engines["tools"])
    assert sim == vllm
