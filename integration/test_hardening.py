"""Hostile client input through a real Envoy: each fails inside its own request, the router
keeps serving."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MODEL, status

MSGS = [{"role": "user", "content": "hi"}]


def _serves(stack) -> None:
    resp = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert resp.status_code == 200
    assert httpx.get(f"{stack.admin_url}/live", timeout=5).status_code == 200


@pytest.mark.parametrize("depth", [300, 1000])
def test_deeply_nested_body_is_a_400(stack, depth):
    before = status(stack)["requests"]["terminal"]["invalid_requests"]
    body = (b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "x": '
            % MODEL.encode() + b"[" * depth + b"]" * depth + b"}")
    resp = httpx.post(f"{stack.url}/v1/chat/completions", content=body, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert status(stack)["requests"]["terminal"]["invalid_requests"] == before + 1
    _serves(stack)


@pytest.mark.parametrize("header", ["x-request-timeout-ms", "x-slo-ttft-ms"])
@pytest.mark.parametrize("value", [b"\xb2", b"1\xb2", b"\xd9\xa3"])
def test_non_ascii_digits_in_headers_are_a_400(stack, header, value):
    resp = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30, headers={header: value},
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == header
    _serves(stack)
