"""Seed rows 400 / 404 / 413 through real Envoy, with raw HTTP and the openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import MODEL, status

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hello"}]


def _error(resp: httpx.Response, code: int) -> dict:
    assert resp.status_code == code, resp.text
    assert resp.headers["content-type"] == "application/json"
    return resp.json()["error"]


def test_invalid_json_is_400(http):
    err = _error(http.post(CHAT, content=b'{"model": ', headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error"
    assert "not valid JSON" in err["message"]


def test_body_must_be_an_object(http):
    err = _error(http.post(CHAT, json=[1, 2]), 400)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ({"messages": MSGS, "stream": "yes"}, "stream"),
    ({"messages": MSGS, "max_tokens": "ten"}, "max_tokens"),
    ({"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSGS, "return_token_ids": 1}, "return_token_ids"),
    ({"messages": MSGS, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ({"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSGS, "n": "2"}, "n"),
    ({"messages": MSGS, "model": 7}, "model"),
    ({"messages": MSGS, "tools": {"type": "function"}}, "tools"),
    ({"messages": MSGS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_field_errors_name_the_param(http, body, param):
    err = _error(http.post(CHAT, json={"model": MODEL} | body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_completions_prompt_type(http):
    err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": {"a": 1}}), 400)
    assert err["param"] == "prompt"


def test_openai_client_raises_bad_request_with_message(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=-1)
    assert info.value.status_code == 400
    assert info.value.param == "max_tokens"
    assert "max_tokens" in info.value.message


def test_model_not_found_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="other-model", messages=MSGS)
    assert info.value.code == "model_not_found"
    assert "other-model" in info.value.message


@pytest.mark.parametrize("param", ["n", "best_of"])
def test_sampling_width(client, param):
    with pytest.raises(openai.BadRequestError) as info:
        if param == "n":
            client.chat.completions.create(model=MODEL, messages=MSGS, n=2)
        else:
            client.completions.create(model=MODEL, prompt="hi", best_of=3)
    assert "Invalid sampling width" in info.value.message
    assert info.value.param == param


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tool_choice": {"type": "custom", "custom": {"name": "x"}}}, "tool_choice"),
])
def test_unsupported_non_streaming_options(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MSGS, **kwargs)
    assert info.value.param == param
    assert "not supported for non-streaming" in info.value.message


def test_streaming_audio_modality_is_forwarded(client):
    # Only non-streaming assembly cannot carry audio; a stream goes to the engine.
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, stream=True,
                                            modalities=["text", "audio"], max_tokens=3)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_413_with_content_length(http, stack):
    before = status(stack)["requests"]
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70000}]}
    err = _error(http.post(CHAT, json=big), 413)
    assert err["code"] == "request_too_large"
    after = status(stack)["requests"]
    assert after["terminal"]["invalid_requests"] == before["terminal"]["invalid_requests"] + 1
    assert after["unsized_offered"] == before["unsized_offered"] + 1


def test_413_without_content_length(http):
    def chunks():
        yield b'{"model": "narwhal-sim", "messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"y" * 4096
        yield b'"}]}'

    resp = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in resp.request.headers
    assert _error(resp, 413)["code"] == "request_too_large"


def test_chunked_body_under_limit_is_served(http):
    def chunks():
        yield b'{"model": "narwhal-sim", "max_tokens": 4, "messages": [{"role": "user", '
        yield b'"content": "chunked"}]}'

    resp = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4
