"""`narwhal demo` brings the whole path up, serves curl-style requests, and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from narwhal.launch import free_port


def test_demo_serves_and_stops():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "narwhal", "demo", "--port", str(port),
                             "--engines", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:  # the demo prints its banner once everything is ready
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        assert any("Narwhal demo ready" in ln for ln in lines), "".join(lines)
        body = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 3}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        assert httpx.post(url, json=body, timeout=30).json()["choices"][0]["message"]["content"]
        streamed = httpx.post(url, json=body | {"stream": True}, timeout=30).text
        assert streamed.rstrip().endswith("data: [DONE]")
        status = httpx.get("http://127.0.0.1:9090/status", timeout=5).json()
        assert len(status["engines"]) == 2
    finally:
        os.killpg(proc.pid, signal.SIGINT) if proc.poll() is None else None
        rc = proc.wait(30)
    assert rc == 0
    # The demo stopped every process it started: nothing answers on its ports any more.
    for url in (f"http://127.0.0.1:{port}/", "http://127.0.0.1:9090/live",
                "http://127.0.0.1:9901/ready"):
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=2)
