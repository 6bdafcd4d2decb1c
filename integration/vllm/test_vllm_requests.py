"""Every request kind through Envoy + Narwhal in front of real vLLM 0.32, side by side with
the same request sent to vLLM directly.

For each request: the stream a client gets through Narwhal equals vLLM's own stream
(engine-stamped ids aside); the assembled non-streaming response equals the test's own
fold of vLLM's stream, and vLLM's own non-streaming response where vLLM is consistent
with itself; and Narwhal's measured output tokens (``/status``) equal vLLM's
``usage.completion_tokens``.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import openai
import pytest

from narwhal.server.telemetry import parse_vllm_metrics

from ..conftest import wait_for
from .conftest import Pair
from .engine import SERVED_MODEL
from .wire import core, fold, normalise_events, shapes, sse, usage_of

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
MSGS = [{"role": "system", "content": "You answer tersely."},
        {"role": "user", "content": "What is the weather in Oslo today?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}

CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]}},
        "required": ["city"], "additionalProperties": False}
CITY_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
YEAR = "[0-9]{4}"
# A JSON answer as a regex: under a JSON grammar a random-weight model emits whitespace
# until max_tokens (vLLM 0.32's `disable_any_whitespace` did not stop it), so the
# constraint that can be checked on a finished answer is one without free whitespace.
CITY_JSON = r'\{"city":"(Oslo|Bergen)"\}'


@dataclass(frozen=True)
class Case:
    id: str
    path: str
    body: dict[str, Any]
    variant: str = "tools"
    # vLLM's own non-streaming answer differs from its stream for this request (a vLLM
    # inconsistency): the assembled response is compared with the stream's fold only.
    direct_non_streaming: bool = True
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.path == CHAT


def _matrix() -> list[Case]:
    cases = []
    for path, base in ((CHAT, {"messages": MSGS}), (TEXT, {"prompt": "The narwhal swims"})):
        kind = "chat" if path == CHAT else "text"
        for usage in (False, True):
            for ids in (False, True):
                body = base | {"max_tokens": 12, "seed": 11}
                if usage:
                    body["stream_options"] = {"include_usage": True}
                if ids:
                    body["return_token_ids"] = True
                cases.append(Case(f"{kind}-usage{int(usage)}-ids{int(ids)}", path, body))
    return cases


CASES = _matrix() + [
    Case("chat-logprobs", CHAT, {"messages": MSGS, "max_tokens": 6, "seed": 3, "logprobs": True,
                                 "top_logprobs": 3}),
    Case("text-logprobs", TEXT, {"prompt": "Arctic", "max_tokens": 6, "seed": 3, "logprobs": 2}),
    Case("chat-max-completion-tokens", CHAT, {"messages": MSGS, "max_completion_tokens": 9,
                                              "seed": 5, "n": 1}),
    # vLLM puts usage on every chunk only with include_usage too; Narwhal always asks for
    # include_usage upstream, so the client's own options decide what it sees
    Case("chat-continuous-usage", CHAT, {"messages": MSGS, "max_tokens": 6, "seed": 3,
                                         "stream_options": {"include_usage": True,
                                                            "continuous_usage_stats": True}}),
    Case("chat-continuous-usage-only", CHAT, {"messages": MSGS, "max_tokens": 6, "seed": 3,
                                              "stream_options": {"continuous_usage_stats": True}}),
    Case("chat-stop", CHAT, {"messages": MSGS, "max_tokens": 40, "seed": 5, "stop": ["e", "a"]}),
    Case("text-stop", TEXT, {"prompt": "Ice", "max_tokens": 40, "seed": 5, "stop": "o"}),
    Case("text-echo", TEXT, {"prompt": "Echo this", "max_tokens": 5, "seed": 2, "echo": True}),
    Case("text-echo-ids", TEXT, {"prompt": "Echo this", "max_tokens": 5, "seed": 2, "echo": True,
                                 "return_token_ids": True}),
    Case("text-token-prompt", TEXT, {"prompt": [12, 40, 77, 301, 9], "max_tokens": 7, "seed": 4,
                                     "return_token_ids": True}),
    # vLLM's own sampling and template options, passed through untouched.
    Case("chat-vllm-options", CHAT, {"messages": MSGS, "max_tokens": 10, "seed": 7,
                                     "stop_token_ids": [65], "skip_special_tokens": False,
                                     "chat_template_kwargs": {"enable_thinking": False}}),
    Case("chat-openai-options", CHAT, {
        "messages": [MSGS[0], MSGS[1] | {"name": "bob"}], "max_tokens": 10, "seed": 7,
        "response_format": {"type": "text"}, "parallel_tool_calls": False,
        "tools": [WEATHER | {"function": WEATHER["function"] | {"strict": True}}],
        "tool_choice": "auto"}),
    Case("text-echo-logprobs", TEXT, {"prompt": "Echo this", "max_tokens": 4, "seed": 2,
                                      "echo": True, "logprobs": 1}),
    # A batch of one prompt (how evaluation harnesses send a prompt): vLLM's one prompt.
    Case("text-batch-of-one", TEXT, {"prompt": ["The narwhal swims"], "max_tokens": 7,
                                     "seed": 4, "echo": True}),
    Case("text-token-prompt-batch-of-one", TEXT, {"prompt": [[12, 40, 77, 301, 9]],
                                                  "max_tokens": 7, "seed": 4,
                                                  "return_token_ids": True}),
    Case("chat-long", CHAT, {"messages": MSGS, "max_tokens": 300, "seed": 8}),
    Case("tools-auto", CHAT, {"messages": MSGS, "max_tokens": 30, "seed": 9,
                              "tools": [WEATHER, CLOCK], "tool_choice": "auto"}),
    Case("tools-required-parallel", CHAT, {"messages": MSGS, "max_tokens": 120, "seed": 1,
                                           "tools": [WEATHER, CLOCK], "tool_choice": "required",
                                           "parallel_tool_calls": True}),
    Case("tools-required-ids", CHAT, {"messages": MSGS, "max_tokens": 120, "seed": 2,
                                      "tools": [WEATHER, CLOCK], "tool_choice": "required",
                                      "return_token_ids": True}),
    # Calls cut at max_tokens: vLLM's own non-streaming answer then returns the raw call
    # text as content, while its stream returned a tool call (Narwhal assembles the stream).
    Case("tools-required-cut", CHAT, {"messages": MSGS, "max_tokens": 120, "seed": 0,
                                      "tools": [WEATHER, CLOCK], "tool_choice": "required"},
         direct_non_streaming=False),
    Case("tools-named", CHAT, {"messages": MSGS, "max_tokens": 60, "seed": 9, "tools": [WEATHER],
                               "tool_choice": {"type": "function",
                                               "function": {"name": "get_weather"}}},
         direct_non_streaming=False),
    Case("tools-named-cut", CHAT, {"messages": MSGS, "max_tokens": 12, "seed": 9,
                                   "tools": [WEATHER],
                                   "tool_choice": {"type": "function",
                                                   "function": {"name": "get_weather"}}},
         direct_non_streaming=False),
    Case("tools-include-reasoning-false", CHAT, {"messages": MSGS, "max_tokens": 8, "seed": 6,
                                                 "include_reasoning": False}),
    # No max_tokens: vLLM's default (the rest of the context) and Narwhal's projection of it.
    Case("chat-no-max-tokens", CHAT, {"messages": MSGS, "seed": 13}),
    Case("chat-usage-false", CHAT, {"messages": MSGS, "max_tokens": 6, "seed": 3,
                                    "stream_options": {"include_usage": False}}),
    # OpenAI's newer fields: the developer role, store and metadata (vLLM ignores the last two).
    Case("chat-developer-role", CHAT, {"messages": [{"role": "developer", "content": "Be terse."},
                                                    MSGS[1]],
                                       "max_tokens": 6, "seed": 3, "store": False,
                                       "metadata": {"team": "narwhal"}}),
    # An agent's second turn: the assistant's call (content null) and the tool's answer.
    Case("tools-result-turn", CHAT, {"messages": MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "Sleet, 2 C"}],
        "tools": [WEATHER], "max_tokens": 16, "seed": 7}),
    Case("tools-choice-none", CHAT, {"messages": MSGS, "max_tokens": 12, "seed": 7,
                                     "tools": [WEATHER, CLOCK], "tool_choice": "none"}),
    Case("chat-logit-bias", CHAT, {"messages": MSGS, "max_tokens": 8, "seed": 7,
                                   "logit_bias": {"65": 100, "66": -100}}),
    # Structured outputs (vLLM's grammar backend constrains the sampled tokens; the
    # events carry nothing new, but users send these every day).
    Case("json-object", CHAT, {"messages": MSGS, "max_tokens": 24, "seed": 4,
                               "response_format": {"type": "json_object"}}),
    Case("json-schema", CHAT, {"messages": MSGS, "max_tokens": 40, "seed": 4,
                               "response_format": CITY_SCHEMA}),
    Case("text-structured-regex", TEXT, {"prompt": "Year:", "max_tokens": 8, "seed": 4,
                                         "structured_outputs": {"regex": YEAR}}),
    Case("reasoning", CHAT, {"messages": MSGS, "max_tokens": 24, "seed": 12}, variant="reasoning"),
    Case("reasoning-ids", CHAT, {"messages": MSGS, "max_tokens": 24, "seed": 12,
                                 "return_token_ids": True}, variant="reasoning"),
    Case("reasoning-excluded", CHAT, {"messages": MSGS, "max_tokens": 10, "seed": 12,
                                      "include_reasoning": False}, variant="reasoning"),
    Case("reasoning-text", TEXT, {"prompt": "Think", "max_tokens": 10, "seed": 12},
         variant="reasoning"),
]


# A cross-section of the cases again through two worker processes (serving.workers).
WORKER_CASES = [replace(c, id=f"workers-{c.id}", variant="workers") for c in CASES
                if c.id in ("chat-logprobs", "text-echo-ids", "chat-long",
                            "tools-required-parallel", "tools-required-ids")]


def _pair(request, case: Case) -> Pair:
    return request.getfixturevalue(f"{case.variant}_pair")


def _body(case: Case, stream: bool) -> dict[str, Any]:
    body = {"model": SERVED_MODEL} | case.body
    if stream:
        return body | {"stream": True}
    return {k: v for k, v in body.items() if k != "stream_options"}


def _head(event: dict[str, Any]) -> dict[str, Any]:
    """The first event less the output it may share with later tokens."""
    return event | {"choices": [{k: v for k, v in c.items()
                                 if k not in ("text", "token_ids", "logprobs")}
                                for c in event["choices"]]}


def _reference_tokens(pair: Pair, case: Case) -> int:
    """vLLM's own completion_tokens for this request (same seed: same output)."""
    body = _body(case, True) | {"stream_options": {"include_usage": True}}
    with pair.direct() as c:
        status, events = sse(c, case.path, body)
    assert status == 200
    usage = usage_of(events)
    assert usage is not None
    return usage["completion_tokens"]


@pytest.mark.parametrize("case", CASES + WORKER_CASES, ids=lambda c: c.id)
def test_stream_equals_vllm_and_tokens_counted(request, case: Case):
    pair = _pair(request, case)
    body = _body(case, True)
    with pair.direct() as c:
        status, direct = sse(c, case.path, body)
    assert status == 200
    before = pair.settled_engine_status()["output_tokens"]
    with pair.routed() as c:
        status, routed = sse(c, case.path, body)
    counted = pair.settled_engine_status()["output_tokens"] - before
    assert status == 200
    routed_n, direct_n = normalise_events(routed), normalise_events(direct)
    # Same output, same wire structure; event boundaries are the engine's timing.
    assert fold(routed, case.chat, ids=True) == fold(direct, case.chat, ids=True)
    assert shapes(routed_n) == shapes(direct_n)
    assert _head(routed_n[0]) == _head(direct_n[0])  # where the prompt IDs go, for one
    tail = [e for e in direct_n if e == "[DONE]" or not e["choices"]]
    assert [e for e in routed_n if e == "[DONE]" or not e["choices"]] == tail
    assert routed[-1] == "[DONE]"
    assert counted == _reference_tokens(pair, case)


@pytest.mark.parametrize("case", CASES + WORKER_CASES, ids=lambda c: c.id)
def test_assembled_equals_vllm(request, case: Case):
    pair = _pair(request, case)
    body = _body(case, False)
    with pair.direct() as c:
        direct = c.post(case.path, json=body)
        status, stream = sse(c, case.path, _body(case, True) | {
            "stream_options": {"include_usage": True}})
    assert direct.status_code == 200 and status == 200
    before = pair.settled_engine_status()["output_tokens"]
    with pair.routed() as c:
        routed = c.post(case.path, json=body)
    counted = pair.settled_engine_status()["output_tokens"] - before
    assert routed.status_code == 200, routed.text
    assembled = core(routed.json())
    folded = fold(stream, case.chat, ids=bool(case.body.get("return_token_ids")))
    for key, value in folded.items():
        assert assembled[key] == value, key
    if case.direct_non_streaming:
        assert assembled == core(direct.json())
    assert counted == routed.json()["usage"]["completion_tokens"] == usage_of(stream)[
        "completion_tokens"]


def test_openai_client_streams_and_assembles_tool_calls(tools_pair):
    """The official client parses both shapes, and they agree."""
    client = tools_pair.openai()
    kw = {"model": SERVED_MODEL, "messages": MSGS, "max_tokens": 120, "seed": 1,
          "tools": [WEATHER, CLOCK], "tool_choice": "required"}
    resp = client.chat.completions.create(**kw)
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls"
    assert len(calls) == 2 and all(c.function.name in ("get_weather", "get_time") for c in calls)
    assert len({c.id for c in calls}) == 2
    assert resp.choices[0].message.content == ""
    chunks = list(client.chat.completions.create(stream=True, **kw))
    names = [tc.function.name for c in chunks for ch in c.choices
             for tc in ch.delta.tool_calls or () if tc.function and tc.function.name]
    assert names == [c.function.name for c in calls]
    assert chunks[-1].system_fingerprint == resp.system_fingerprint is not None


def test_reasoning_is_assembled(reasoning_pair):
    resp = reasoning_pair.openai().chat.completions.create(
        model=SERVED_MODEL, messages=MSGS, max_tokens=16, seed=12)
    assert resp.choices[0].message.model_extra["reasoning"]
    assert resp.usage.completion_tokens == 16


@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusal_in_the_stream_keeps_vllm_status_and_envelope(tools_pair, stream):
    """``top_logprobs`` 50: vLLM opens the stream, then sends a 400 error event."""
    body = {"model": SERVED_MODEL, "messages": MSGS, "max_tokens": 4, "logprobs": True,
            "top_logprobs": 50, "stream": stream}
    before = tools_pair.stack_counts()
    with tools_pair.direct() as c:
        direct_status, direct = sse(c, CHAT, body) if stream else (None, None)
        direct_resp = None if stream else c.post(CHAT, json=body)
    with tools_pair.routed() as c:
        if stream:
            status, routed = sse(c, CHAT, body)
            assert status == direct_status == 200
            assert routed == direct and routed[-1] == "[DONE]"
            assert routed[0]["error"]["param"] == "logprobs"
        else:
            resp = c.post(CHAT, json=body)
            assert resp.status_code == direct_resp.status_code == 400
            assert resp.json() == direct_resp.json()
    after = tools_pair.stack_counts()
    assert after["invalid_requests"] == before["invalid_requests"] + 1
    assert after["failed"] == before["failed"]


# Fields Narwhal does not interpret, which vLLM's own validation refuses before a stream:
# the client gets vLLM's answer, whatever Narwhal's rewrite of the request.
ENGINE_REFUSALS: list[tuple[str, str, dict[str, Any]]] = [
    ("max-tokens-over-context", CHAT, {"messages": MSGS, "max_tokens": 5000}),
    ("seed-past-int64", CHAT, {"messages": MSGS, "max_tokens": 2, "seed": 2**64}),
    ("top-p-over-one", CHAT, {"messages": MSGS, "max_tokens": 2, "top_p": 2}),
    ("stop-not-a-string", CHAT, {"messages": MSGS, "max_tokens": 2, "stop": 5}),
    ("min-tokens-over-max", CHAT, {"messages": MSGS, "max_tokens": 2, "min_tokens": 5}),
    ("user-content-null", CHAT, {"messages": [{"role": "user", "content": None}],
                                 "max_tokens": 2}),
    ("suffix", TEXT, {"prompt": "The narwhal", "max_tokens": 2, "suffix": "x"}),
]


@pytest.mark.parametrize("name,path,extra", ENGINE_REFUSALS,
                         ids=[r[0] for r in ENGINE_REFUSALS])
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_engine_error_before_the_stream(tools_pair, name, path, extra, stream):
    body = {"model": SERVED_MODEL, "stream": stream} | extra
    before = tools_pair.stack_counts()
    with tools_pair.direct() as c:
        direct = c.post(path, json=body)
    with tools_pair.routed() as c:
        routed = c.post(path, json=body)
    assert routed.status_code == direct.status_code == 400
    assert routed.json() == direct.json()
    after = tools_pair.stack_counts()
    assert after["invalid_requests"] == before["invalid_requests"] + 1


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": MSGS, "max_tokens": 2, "prompt_logprobs": 1}),
    (TEXT, {"prompt": "The narwhal", "max_tokens": 2, "prompt_logprobs": 1})])
def test_non_streaming_prompt_logprobs_are_refused_by_narwhal_not_the_engine(tools_pair, path,
                                                                            body):
    """vLLM serves them only without a stream, and Narwhal reads the engine's stream: a
    clear 400 naming the field, instead of vLLM's "not available when stream=True" for a
    request the client sent without a stream."""
    body = {"model": SERVED_MODEL} | body
    before = tools_pair.stack_counts()
    with tools_pair.direct() as d, tools_pair.routed() as r:
        assert d.post(path, json=body).status_code == 200
        routed = r.post(path, json=body)
    assert routed.status_code == 400
    assert routed.json()["error"]["param"] == "prompt_logprobs"
    assert "non-streaming" in routed.json()["error"]["message"]
    after = tools_pair.stack_counts()
    assert after["invalid_requests"] == before["invalid_requests"] + 1


def test_openai_client_sees_engine_refusal_as_bad_request(tools_pair):
    with pytest.raises(openai.BadRequestError) as info:
        tools_pair.openai().chat.completions.create(
            model=SERVED_MODEL, messages=MSGS, max_tokens=4, logprobs=True, top_logprobs=50)
    assert "logprobs" in info.value.message


@pytest.mark.parametrize("stream", [False, True], ids=["assembled", "streamed"])
def test_structured_outputs_hold_through_narwhal(tools_pair, stream):
    """vLLM's grammar backend constrains what the engine samples; through Narwhal (whose
    upstream request is always a stream, assembled back for a non-streaming client) the
    answer still holds the schema and the regex."""
    client = tools_pair.openai()
    chat = client.chat.completions.create(model=SERVED_MODEL, messages=MSGS, max_tokens=40,
                                          seed=4, extra_body={"structured_outputs": {"regex": CITY_JSON}},
                                          stream=stream)
    text = client.completions.create(model=SERVED_MODEL, prompt="Year:", max_tokens=8, seed=4,
                                     extra_body={"structured_outputs": {"regex": YEAR}},
                                     stream=stream)
    if stream:
        content = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        digits = "".join(c.choices[0].text for c in text if c.choices)
    else:
        content, digits = chat.choices[0].message.content, text.choices[0].text
    assert json.loads(content) in ({"city": "Oslo"}, {"city": "Bergen"})
    assert re.fullmatch(YEAR, digits), digits


def test_models_route_is_vllms(tools_pair):
    with tools_pair.direct() as d, tools_pair.routed() as r:
        direct, routed = d.get("/v1/models").json(), r.get("/v1/models").json()
    assert routed["data"][0]["id"] == direct["data"][0]["id"] == SERVED_MODEL
    assert routed["data"][0]["max_model_len"] == 2048


def test_engine_cache_size_is_read_from_vllms_metrics(tools_pair):
    """vLLM's vllm:cache_config_info (block size x GPU blocks) bounds the prefix index."""
    with tools_pair.direct() as d:
        text = d.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    tokens = int(labels["block_size"]) * int(labels["num_gpu_blocks"])
    st = tools_pair.engine_status()
    assert st["kv_capacity_tokens"] == tokens > 0
    assert 0 < st["prefix_index_capacity"] <= 65536


def test_a_client_that_leaves_mid_stream_leaks_nothing_on_narwhal_or_vllm(tools_pair):
    """A client that closes its connection a few tokens into a long stream: Envoy resets
    the engine's stream, vLLM stops the request (its own running count returns to 0 and
    far fewer tokens than asked were made), and Narwhal gives back the request's retention
    and engine slot and counts its end: nothing leaks on either side.

    The answer takes vLLM seconds (1,800 tokens, 20 logprobs each), but this test process
    has stalled for seconds while vLLM generates, between reading and closing (a fresh
    clone's run here: vLLM made all 1,800): an attempt whose answer was complete before
    the close reached vLLM did not test the case, and is made again (three at most; a
    router that never stops the engine fails all three)."""
    for _attempt in range(3):
        made = _leave_mid_stream_once(tools_pair)
        if made < 1800:
            break
    assert 3 <= made < 1800  # vLLM stopped, not ran to the end unseen


def _leave_mid_stream_once(pair: Pair) -> float:
    """Read four events of a long stream, close, wait until the request ended leaving
    nothing; the tokens vLLM generated for it (by its own counter)."""
    before = pair.status()
    made0 = _generated(pair)
    body = {"model": SERVED_MODEL, "messages": MSGS, "max_tokens": 1800, "seed": 1,
            "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}
    with pair.routed() as c, c.stream("POST", CHAT, json=body) as resp:
        assert resp.status_code == 200
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: {")
            if events == 4:  # the role event and three carrying tokens
                break  # leaving the blocks closes the unread response's connection
    wait_for(lambda: _ended_leaving_nothing(pair, before), timeout=60)
    return _generated(pair) - made0


def test_a_client_that_leaves_while_its_answer_is_assembled_leaks_nothing(tools_pair):
    """The non-streaming case: Narwhal is assembling the answer from vLLM's stream when the
    client closes its connection (once Narwhal has the first token: its engine's decode
    count is 1): vLLM stops and nothing stays held or in flight.

    The answer takes vLLM seconds (1,800 tokens, each with 20 logprobs), and on this
    2-core machine the test process has stalled for seconds while vLLM generates (its
    first look at /status came after the answer was complete): an attempt whose request
    ended before it was seen decoding did not test the case, and is made again (three at
    most). Not vLLM's own running gauge: its API server answers /metrics late when busy."""
    body = json.dumps({"model": SERVED_MODEL, "messages": MSGS, "max_tokens": 1800, "seed": 1,
                       "ignore_eos": True, "logprobs": True, "top_logprobs": 20}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: narwhal\r\n"
               b"content-type: application/json\r\ncontent-length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    with httpx.Client(base_url=tools_pair.stack.admin_url, timeout=10) as admin:
        for _attempt in range(3):
            seen, made0 = _leave_once_decoding(tools_pair, admin, request)
            # An attempt in which vLLM ran to the end before the close reached it did not
            # test the case either (a router that never stops the engine fails all three).
            if seen == "decoding" and _generated(tools_pair) - made0 < 1800:
                break
        assert seen == "decoding", "every attempt ended before it was seen decoding"
    assert 0 < _generated(tools_pair) - made0 < 1800


def _leave_once_decoding(pair: Pair, admin: httpx.Client, request: bytes) -> tuple[str, float]:
    """Send ``request`` on a raw socket and close it once Narwhal has its first token (or
    once Narwhal counts its end, if that is what the test sees first); then wait until it
    ended leaving nothing. What was seen, and vLLM's generated tokens before it."""
    before, made0 = admin.get("/status").json(), _generated(pair)

    def look() -> str | None:
        s = admin.get("/status").json()
        if s["engines"][0]["decode"] == 1:
            return "decoding"
        return "ended" if _ends(s) > _ends(before) else None

    with socket.create_connection(("127.0.0.1", pair.stack.port), timeout=30) as sock:
        sock.sendall(request)
        seen = wait_for(look, timeout=60)
    wait_for(lambda: _ended_leaving_nothing(pair, before), timeout=60)
    return seen, made0


def _ends(status: dict) -> int:
    """The request ends Narwhal has counted, of every terminal class (its /status)."""
    return sum(status["requests"]["terminal"].values())


def _ended_leaving_nothing(pair: Pair, before: dict) -> bool:
    """A request ended since ``before`` (Narwhal counted its end), and nothing is held or
    in flight on Narwhal nor running on vLLM."""
    s = pair.status()
    if _ends(s) <= _ends(before):
        return False
    return (s["requests"]["in_flight"], s["requests"]["held"], s["engines"][0]["in_flight"],
            _running(pair)) == (0, 0, 0, 0.0)


def _running(pair: Pair) -> float | None:
    return parse_vllm_metrics(httpx.get(f"{pair.engine.url}/metrics", timeout=10).text).get(
        "running")


def _generated(pair: Pair) -> float:
    """vLLM's own count of the tokens it has generated (its metrics, not Narwhal's)."""
    text = httpx.get(f"{pair.engine.url}/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:generation_tokens_total")]
    assert values, "vLLM's metrics have no vllm:generation_tokens_total"
    return sum(values)


def _burst_request(pair: Pair, i: int) -> int:
    """One of the burst's requests (chat or text, streamed or assembled, by ``i``); its
    status checked, its ``usage.completion_tokens`` returned."""
    path = CHAT if i % 2 else TEXT
    body: dict[str, Any] = {"model": SERVED_MODEL, "max_tokens": 8 + 7 * (i % 9), "seed": i}
    body |= {"messages": MSGS} if path == CHAT else {"prompt": f"Count to {i}:"}
    if i % 3:
        body["ignore_eos"] = True  # most run to max_tokens: long enough to overlap
    with pair.routed() as c:
        if i % 4 < 2:
            status, events = sse(c, path, body | {"stream": True,
                                                  "stream_options": {"include_usage": True}})
            assert status == 200 and events[-1] == "[DONE]", events[-1]
            usage = usage_of(events)
        else:
            resp = c.post(path, json=body)
            assert resp.status_code == 200, resp.text
            usage = resp.json()["usage"]
    assert usage is not None and 1 <= usage["completion_tokens"] <= body["max_tokens"]
    return usage["completion_tokens"]


def test_a_burst_of_concurrent_requests_is_counted_exactly_by_narwhal_and_vllm(tools_pair):
    """Twenty-four requests at once (chat and text, streamed and assembled): more than the
    engine's prefill slots, so Narwhal queues some, and vLLM batches the rest, merging
    tokens into events when its API server falls behind. Every request succeeds, and the
    output tokens Narwhal counted by ID, the sum of the answers' usage and vLLM's own
    generated-token counter are the same number; afterwards nothing is held, queued or in
    flight on Narwhal nor running on vLLM."""
    before, made0 = tools_pair.status(), _generated(tools_pair)
    with ThreadPoolExecutor(24) as pool:
        counted = sum(pool.map(lambda i: _burst_request(tools_pair, i), range(24)))
    wait_for(lambda: tools_pair.status()["requests"]["in_flight"] == 0 and _running(tools_pair)
             == 0.0, timeout=60)
    after = tools_pair.status()
    engine0, engine = before["engines"][0], after["engines"][0]
    assert engine["profiles"] == engine0["profiles"]  # no probe ran meanwhile
    assert engine["output_tokens"] - engine0["output_tokens"] == counted
    assert _generated(tools_pair) - made0 == counted
    ended = after["requests"]["terminal"]
    assert ended["completed"] - before["requests"]["terminal"]["completed"] == 24
    assert _ends(after) - _ends(before) == 24
    assert (after["requests"]["held"], after["requests"]["queued"], engine["in_flight"]) == (0, 0, 0)


def _leaving_request(pair: Pair, i: int) -> tuple[str, bool]:
    """Request ``i`` of the leaving clients (chat or text, streamed or assembled, up to 300
    tokens, all made: ``ignore_eos``), made by a client that, at random (seeded by ``i``),
    reads its whole answer, leaves after a few events or a moment, or closes partway
    through sending its body. What it did, and whether its headers reached Envoy whole
    (only then does Narwhal see the request)."""
    rng = random.Random(i)
    chat = rng.random() < 0.5
    path = CHAT if chat else TEXT
    body: dict[str, Any] = {"model": SERVED_MODEL, "max_tokens": rng.randint(1, 300),
                            "ignore_eos": True, "seed": i}
    body |= {"messages": MSGS} if chat else {"prompt": f"Count to {i}:"}
    leave = rng.choice(("reads", "leaves", "leaves", "cuts"))
    if rng.random() < 0.5 and leave != "cuts":
        keep = rng.randint(0, 30) if leave == "leaves" else None
        events: list[str] = []
        with pair.routed() as c, c.stream("POST", path, json=body | {"stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if keep is not None and len(events) >= keep:
                    break  # leaving the blocks closes the connection mid-answer
                if line.startswith("data: "):
                    events.append(line)
        if keep is None:
            assert events[-1] == "data: [DONE]"
        return leave, True
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: narwhal\r\nconnection: close\r\n"
            f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", pair.stack.port), timeout=60) as sock:
        if leave == "cuts":
            cut = rng.randint(1, len(head) + len(raw) - 1)
            sock.sendall((head + raw)[:cut])
            return leave, cut >= len(head)
        sock.sendall(head + raw)
        if leave == "leaves":
            sock.settimeout(0.001 + rng.random() * 0.4)  # leave then, answered or not
            with contextlib.suppress(TimeoutError):
                sock.recv(1)
            return leave, True
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b'"usage"' in rest
    return leave, True


@pytest.mark.parametrize("variant", ["tools_pair", "workers_pair"],
                         ids=["one-process", "workers"])
def test_clients_that_leave_at_random_leave_nothing_behind(request, variant):
    """Ninety-six clients, twelve at a time, each reading its whole answer, leaving after a
    few events or a moment (streamed or assembled), or closing while it sends its body:
    every request whose headers reached Envoy whole is offered once and ends once (as
    completed, or cancelled), those cut inside their headers never reach Narwhal, and
    afterwards nothing is held, queued or in flight on Narwhal (in one process and with
    serving.workers: 2), no engine slot is taken, and nothing runs on vLLM."""
    pair: Pair = request.getfixturevalue(variant)
    before = pair.settled()
    with ThreadPoolExecutor(12) as pool:
        done = list(pool.map(lambda i: _leaving_request(pair, i), range(96)))
    assert {kind for kind, _ in done} == {"reads", "leaves", "cuts"}
    reached = sum(seen for _, seen in done)
    assert 48 < reached < 96  # some cut inside their headers, most not

    def quiet() -> dict | None:
        s = pair.status()
        e = s["engines"][0]
        return s if (s["requests"]["in_flight"], s["requests"]["held"], s["requests"]["queued"],
                     s["requests"]["held_bytes"], e["in_flight"], e["prefill"], e["decode"],
                     _running(pair)) == (0, 0, 0, 0, 0, 0, 0, 0.0) else None

    after = wait_for(quiet, timeout=120)
    offered = after["requests"]["offered"] - before["requests"]["offered"]
    ends = {k: v - before["requests"]["terminal"][k]
            for k, v in after["requests"]["terminal"].items()}
    assert offered == reached == sum(ends.values())
    assert ends["completed"] >= sum(kind == "reads" for kind, _ in done)
    assert {k for k, v in ends.items() if v} <= {"completed", "cancelled"}
