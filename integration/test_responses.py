"""Seed "Streaming and response assembly" and "Token identity" rows, end to end."""

from __future__ import annotations

import math
import time
import uuid

import httpx
import openai
import orjson
import pytest

from .conftest import MODEL, client_for, status
from .fold import assembled_chat, fold_chat

MSGS = [{"role": "user", "content": "tell me about narwhals"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
COMPARED = ("content", "reasoning", "reasoning_content", "refusal", "tool_calls",
            "function_call", "logprobs_content", "logprobs_refusal", "finish_reason",
            "stop_reason", "usage", "id", "token_ids")


def both(client: openai.OpenAI, headers: dict | None = None, **kw):
    """The same seeded request, once streamed (folded here) and once assembled by Narwhal,
    under one ``x-request-id``: the engine names its answer after it, as vLLM does."""
    headers = {"x-request-id": f"both-{uuid.uuid4().hex}"} | (headers or {})
    kw = {"model": MODEL, "messages": MSGS, "seed": 7, "extra_headers": headers} | kw
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    return fold_chat(chunks), assembled_chat(client.chat.completions.create(**kw)), chunks


def assert_same(streamed: dict, assembled: dict) -> None:
    for key in COMPARED:
        assert assembled[key] == streamed[key], key


def test_content_concatenates_and_matches_stream(client):
    streamed, assembled, _ = both(client, max_tokens=12)
    assert_same(streamed, assembled)
    assert assembled["content"] and assembled["finish_reason"] == "length"
    assert assembled["usage"]["completion_tokens"] == 12


def test_reasoning_fields_concatenate(reasoning_stack):
    streamed, assembled, _ = both(client_for(reasoning_stack), max_tokens=10)
    assert_same(streamed, assembled)
    assert assembled["reasoning"] and assembled["reasoning"] == assembled["reasoning_content"]
    assert assembled["content"]


def test_refusal_concatenates(client):
    streamed, assembled, _ = both(client, {"x-sim-output": "refusal"}, max_tokens=6)
    assert_same(streamed, assembled)
    assert assembled["refusal"] and assembled["content"] is None


def test_parallel_tool_calls_grouped_by_index(client):
    streamed, assembled, _ = both(client, {"x-sim-output": "multi-tool"}, tools=TOOLS,
                                  tool_choice="required", max_tokens=10)
    assert_same(streamed, assembled)
    calls = assembled["tool_calls"]
    assert [c["name"] for c in calls] == ["lookup", "search"]
    assert all(c["id"] for c in calls)
    for c in calls:
        assert orjson.loads(c["arguments"])["q"]  # engine-generated JSON, passed through
    assert assembled["finish_reason"] == "tool_calls"


def test_named_tool_choice(client):
    streamed, assembled, _ = both(client, tools=TOOLS, max_tokens=5,
                                  tool_choice={"type": "function", "function": {"name": "search"}})
    assert_same(streamed, assembled)
    assert [c["name"] for c in assembled["tool_calls"]] == ["search"]


def test_legacy_function_call(client):
    streamed, assembled, _ = both(client, {"x-sim-output": "function-call"}, max_tokens=5)
    assert_same(streamed, assembled)
    assert assembled["function_call"]["name"] == "legacy_fn"
    assert orjson.loads(assembled["function_call"]["arguments"])
    assert assembled["finish_reason"] == "function_call"


def test_chat_logprobs_concatenate(client):
    streamed, assembled, _ = both(client, logprobs=True, top_logprobs=2, max_tokens=8)
    assert_same(streamed, assembled)
    assert len(assembled["logprobs_content"]) == 8
    assert len(assembled["logprobs_content"][0]["top_logprobs"]) == 2


def test_refusal_logprobs_concatenate(client):
    streamed, assembled, _ = both(client, {"x-sim-output": "refusal"}, logprobs=True,
                                  max_tokens=5)
    assert_same(streamed, assembled)
    assert len(assembled["logprobs_refusal"]) == 5


def test_text_completion_logprobs_concatenate(client):
    kw = {"model": MODEL, "prompt": "once upon a time", "seed": 3, "max_tokens": 7,
          "logprobs": 2}
    chunks = list(client.completions.create(stream=True, **kw))
    resp = client.completions.create(**kw)
    lp = resp.choices[0].logprobs
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    offsets = [o for c in chunks for ch in c.choices if ch.logprobs for o in ch.logprobs.text_offset]
    values = [v for c in chunks for ch in c.choices if ch.logprobs
              for v in ch.logprobs.token_logprobs]
    assert lp.tokens == tokens and lp.text_offset == offsets and lp.token_logprobs == values
    assert len(lp.top_logprobs) == 7
    assert resp.choices[0].text == "".join(ch.text for c in chunks for ch in c.choices)
    assert resp.object == "text_completion"


def test_stop_reason_survives_usage_frame(client):
    streamed, assembled, chunks = both(client, stop=["zz", "o"])
    assert_same(streamed, assembled)
    assert assembled["stop_reason"] == "o" and assembled["finish_reason"] == "stop"
    assert "o" not in assembled["content"]  # cut before the stop string, as vLLM does
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # usage came after


def test_metadata_retained(client):
    kw = {"model": MODEL, "messages": MSGS, "seed": 11, "max_tokens": 3}
    before = time.time()
    resp = client.chat.completions.create(extra_headers={"x-request-id": "metadata-1"}, **kw)
    after = time.time()
    other = client.chat.completions.create(**kw)  # Envoy names it: so does the engine
    # The engine's, from its stream: like vLLM, the engine names its answer after the
    # request's x-request-id, which Envoy passes on (or sets when the client did not).
    assert resp.id == "chatcmpl-metadata-1" and resp.model == MODEL
    assert other.id.startswith("chatcmpl-") and other.id != resp.id
    # The engine stamps `created` per request (two requests may straddle a second).
    assert math.floor(before) <= resp.created <= math.ceil(after)
    assert resp.object == "chat.completion"


def test_usage_computed_when_engine_omits_it(client):
    resp = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=9,
                                          extra_headers={"x-sim-fault": "omit-usage"})
    assert resp.usage.completion_tokens == 9
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 9


def test_stream_without_include_usage_gets_no_usage_frame(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4,
                                                 stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_hidden_unless_requested(client, stream):
    kw = {"model": MODEL, "messages": MSGS, "max_tokens": 5}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        # As vLLM answers a client that did not ask: the fields are there, null.
        assert all((ch.model_extra or {}).get("token_ids") is None for c in chunks
                   for ch in c.choices)
        assert all((c.model_extra or {}).get("prompt_token_ids") is None for c in chunks)
    else:
        resp = client.chat.completions.create(**kw)
        assert "token_ids" not in (resp.choices[0].model_extra or {})
        assert "prompt_token_ids" not in (resp.model_extra or {})


def test_token_ids_exposed_when_requested(client):
    streamed, assembled, chunks = both(client, max_tokens=6,
                                       extra_body={"return_token_ids": True})
    assert_same(streamed, assembled)
    assert len(assembled["token_ids"]) == 6 == assembled["usage"]["completion_tokens"]
    assert all(isinstance(t, int) and t >= 0 for t in assembled["token_ids"])
    assert (chunks[0].model_extra or {}).get("prompt_token_ids")


@pytest.mark.parametrize("fault", ["omit-token-ids", "bool-token-id", "malformed-token-ids",
                                   "overrun"])
def test_token_identity_failure_non_streaming_is_502(client, stack, fault):
    before = {e["name"]: e["measurement_failures"] for e in status(stack)["engines"]}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6,
                                       extra_headers={"x-sim-fault": fault})
    assert info.value.status_code == 502
    assert "token" in info.value.message.lower()
    after = {e["name"]: e["measurement_failures"] for e in status(stack)["engines"]}
    assert after["sim-a"] == before["sim-a"] + 1


@pytest.mark.parametrize("fault", ["omit-token-ids", "bool-token-id", "malformed-token-ids",
                                   "error-event", "overrun", "cut-short"])
def test_stream_failure_is_an_sse_error_event(stack, fault):
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body,
                      headers={"x-sim-fault": fault}, timeout=30) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    last = orjson.loads(events[-1])
    assert last["error"]["type"] == "upstream_error"
    assert b"[DONE]" not in b"".join(e.encode() for e in events)
    with pytest.raises(openai.APIError):
        list(client_for(stack).chat.completions.create(
            stream=True, extra_headers={"x-sim-fault": fault}, **{k: v for k, v in body.items()
                                                                    if k != "stream"}))


@pytest.mark.parametrize("fault", ["audio", "annotations", "error-event"])
def test_unsupported_engine_output_is_502(client, fault):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6,
                                       extra_headers={"x-sim-fault": fault})
    assert info.value.status_code == 502
    if fault != "error-event":
        assert fault in info.value.message


def test_openai_dialect_has_no_token_accounting(openai_stack):
    engines = status(openai_stack)["engines"]
    assert [e["token_accounting"] for e in engines] == ["unavailable"]
    client = client_for(openai_stack)
    resp = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5)
    assert resp.usage.completion_tokens == 5 and resp.choices[0].message.content


def test_vllm_dialect_reports_token_ids(stack):
    assert [e["token_accounting"] for e in status(stack)["engines"]] == ["token_ids"]


def test_counters_on_metrics(stack, client):
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{stack.admin_url}/metrics", timeout=5).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("narwhal_requests")}
    before = scrape()
    client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    after = scrape()
    assert after["narwhal_requests_offered_total"] == before["narwhal_requests_offered_total"] + 2
    done = 'narwhal_requests_terminal_total{class="completed"}'
    bad = 'narwhal_requests_terminal_total{class="invalid_requests"}'
    assert after[done] == before[done] + 1 and after[bad] == before[bad] + 1


def test_models_route_passes_through(http):
    resp = http.get("/v1/models")
    assert resp.status_code == 200 and resp.json()["data"][0]["id"] == MODEL
