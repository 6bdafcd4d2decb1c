from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.errors import HttpError
from narwhal.core.request import parse_request, upstream_body

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hé"}]


def parse(body, path=CHAT):
    return parse_request(path, orjson.dumps(body), "m")


def err(body, path=CHAT) -> HttpError:
    with pytest.raises(HttpError) as info:
        parse(body, path)
    return info.value


def test_valid_chat():
    req = parse({"model": "m", "messages": MSGS, "stream": True,
                 "stream_options": {"include_usage": True}, "max_tokens": 5})
    assert req.chat and req.stream and req.include_usage and req.max_tokens == 5
    assert req.prompt_bytes == 3


def test_integers_past_64_bits_reach_the_engine_as_the_client_wrote_them():
    raw = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
           b'"seed": 18446744073709551616, "logit_bias": {"7": -92233720368547758090}, '
           b'"temperature": 0.5, "stream": true}')
    req = parse_request("/v1/chat/completions", raw, "m")
    up = upstream_body(req, token_ids=True)
    assert b'"seed":18446744073709551616' in up and b"-92233720368547758090" in up
    assert json.loads(up) == json.loads(raw) | {
        "stream_options": {"include_usage": True}, "return_token_ids": True,
        "stream_interval": 1}
    # the usual body keeps the fast path
    assert parse({"model": "m", "messages": MSGS, "seed": 2**40}).wide is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=8), st.sampled_from([b"1" * 18, b"9" * 19, b"0"])),
                max_size=12).map(b"".join))
def test_the_wide_integer_test_is_a_run_of_nineteen_digits(raw):
    """The translate-and-find test says what the regex [0-9]{19} says, on any bytes."""
    import re

    from narwhal.core.request import _wide_integer

    assert _wide_integer(raw) == (re.search(rb"[0-9]{19}", raw) is not None)


def test_prompt_logprobs_pass_where_the_engine_can_serve_them():
    assert parse({"model": "m", "messages": MSGS, "prompt_logprobs": 0}).body["prompt_logprobs"] == 0
    assert parse({"model": "m", "messages": MSGS, "stream": True, "prompt_logprobs": 2}).stream


def test_integer_fields_take_integral_floats_as_vllm_does():
    req = parse({"model": "m", "messages": MSGS, "max_tokens": 2.0, "n": 1.0,
                 "stream_options": {}})
    assert req.max_tokens == 2 and isinstance(req.max_tokens, int)


def test_missing_model_means_the_configured_one():
    assert parse({"messages": MSGS}).chat


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "other", "messages": MSGS}, 404, "model"),
    ({"model": "m", "messages": MSGS, "n": 2}, 400, "n"),
    ({"model": "m", "messages": MSGS, "best_of": 2}, 400, "best_of"),
    ({"model": "m", "messages": MSGS, "n": True}, 400, "n"),
    ({"model": "m", "messages": MSGS, "stream": 1}, 400, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     400, "messages[0].content[0].text"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages[0].content[0].text"),
    ({"model": "m", "messages": MSGS, "tools": [{"type": "function", "function": {}}]}, 400,
     "tools[0].function.name"),
    ({"model": "m", "messages": MSGS, "modalities": ["audio"]}, 400, "modalities"),
    ({"model": "m", "messages": MSGS, "stream_options": []}, 400, "stream_options"),
    # vLLM refuses options for a stream the client did not ask for
    ({"model": "m", "messages": MSGS, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ({"model": "m", "messages": MSGS, "max_tokens": 1.5}, 400, "max_tokens"),
    ({"model": "m", "messages": MSGS, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ({"model": "m", "messages": MSGS, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ({"model": "m", "messages": MSGS, "n": 2.0}, 400, "n"),
])
def test_errors(body, status, param):
    e = err(body)
    assert (e.status, e.param) == (status, param)


def test_sampling_width_message():
    assert "Invalid sampling width" in err({"model": "m", "messages": MSGS, "n": 3}).message


def test_model_not_found_code():
    assert err({"model": "x", "messages": MSGS}).code == "model_not_found"


def test_invalid_json():
    with pytest.raises(HttpError) as info:
        parse_request(CHAT, b"{", "m")
    assert info.value.status == 400 and info.value.type == "invalid_request_error"


def test_streaming_may_ask_for_audio():
    assert parse({"model": "m", "messages": MSGS, "stream": True, "modalities": ["audio"]}).stream


def test_completions_prompt_forms():
    assert parse({"prompt": "abc"}, "/v1/completions").prompt_bytes == 3
    assert parse({"prompt": [1, 2, 3]}, "/v1/completions").prompt_bytes == 12
    assert err({"prompt": ["a", "b"]}, "/v1/completions").param == "prompt"
    # a batch of one: as vLLM reads it, the one prompt
    assert parse({"prompt": ["abcd"]}, "/v1/completions").prompt_bytes == 4
    assert parse({"prompt": [[1, 2, 3]]}, "/v1/completions").prompt_bytes == 12
    assert "Invalid sampling width" in err({"prompt": [[1], [2]]}, "/v1/completions").message
    for bad in ([[]], [[1, -2]], [[1, True]], [[1, [2]]], [["a"]]):
        e = err({"prompt": bad}, "/v1/completions")
        assert (e.status, e.param) == (400, "prompt"), bad
    assert err({}, "/v1/completions").param == "prompt"


def test_upstream_rewrite_keeps_other_fields():
    req = parse({"model": "m", "messages": MSGS, "temperature": 0.25, "stream": True,
                 "stream_options": {"include_usage": False, "x": 1}, "custom": {"k": [1]}})
    up = orjson.loads(upstream_body(req, token_ids=True))
    assert up["stream"] is True and up["stream_options"] == {"include_usage": True, "x": 1}
    assert up["return_token_ids"] is True and up["stream_interval"] == 1
    assert up["temperature"] == 0.25 and up["custom"] == {"k": [1]} and up["messages"] == MSGS
    plain = orjson.loads(upstream_body(req, token_ids=False))
    assert "return_token_ids" not in plain and "stream_interval" not in plain
