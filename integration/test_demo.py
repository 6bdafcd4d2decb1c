"""`narwhal demo` brings the whole path up, serves curl-style requests, and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from narwhal.launch import REPO_ROOT, free_port


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """Narwhal installed from a built wheel (not the source tree), in a folder of its own."""
    target = tmp_path_factory.mktemp("installed")
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--target", str(target), str(REPO_ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert (target / "narwhal" / "envoy.yaml").is_file()
    return target


@pytest.mark.parametrize("where", ["source", "installed"])
def test_demo_serves_and_stops(request, where):
    env = os.environ.copy()
    if where == "installed":
        # The installed copy first on the path: it must find its Envoy config as package data.
        env["PYTHONPATH"] = str(request.getfixturevalue("installed"))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "narwhal", "demo", "--port", str(port),
                             "--engines", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env, cwd="/")
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


def test_envoy_config_command_prints_the_shipped_config(installed):
    env = os.environ | {"PYTHONPATH": str(installed)}
    out = subprocess.run([sys.executable, "-m", "narwhal", "envoy-config"], capture_output=True,
                         text=True, timeout=60, env=env, cwd="/")
    assert out.returncode == 0
    assert out.stdout == (installed / "narwhal" / "envoy.yaml").read_text()
    assert "ext_proc" in out.stdout
