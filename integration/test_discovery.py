"""`engines: {discovery: dns}`: the pool is what the name resolves to."""

from __future__ import annotations

import httpx
import pytest

from narwhal.launch import SimSpec, Stack, free_port

from .conftest import MODEL


@pytest.fixture(scope="module")
def discovered():
    port = free_port()
    stack = Stack(sims=[SimSpec("sim-dns", port=port)], model=MODEL,
                  config={"engines": {"discovery": "dns", "name": "localhost", "port": port,
                                      "interval_ms": 500}})
    stack.start()
    yield stack
    stack.stop()


def test_resolved_addresses_become_engines(discovered):
    st = httpx.get(f"{discovered.admin_url}/status", timeout=5).json()
    names = [e["name"] for e in st["engines"]]
    assert "localhost/127.0.0.1" in names
    v4 = next(e for e in st["engines"] if e["name"] == "localhost/127.0.0.1")
    assert v4["eligible"] and v4["endpoint"] == f"127.0.0.1:{discovered.sims[0].port}"
    resp = httpx.post(f"{discovered.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
