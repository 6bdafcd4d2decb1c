"""SIGTERM drains: stop admitting, finish in-flight streams, then exit cleanly."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx

from narwhal.launch import SimSpec, Stack

from .conftest import MODEL, _with_workers

MSGS = [{"role": "user", "content": "drain me"}]


def test_sigterm_finishes_in_flight_then_exits():
    stack = Stack(sims=[SimSpec("d", args=["--tpot-ms", "20"])], model=MODEL,
                  config=_with_workers({})).start()
    try:
        url = f"{stack.url}/v1/chat/completions"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, url, timeout=30, json={
                "model": MODEL, "messages": MSGS, "max_tokens": 50, "stream": True})
            end = time.monotonic() + 10
            while httpx.get(f"{stack.admin_url}/status", timeout=5).json()[
                    "requests"]["in_flight"] == 0:
                assert time.monotonic() < end
                time.sleep(0.02)
            narwhal = stack.proc("narwhal").popen
            narwhal.send_signal(signal.SIGTERM)
            end = time.monotonic() + 10
            while True:  # the router says it is draining, and refuses new work
                ready = httpx.get(f"{stack.admin_url}/ready", timeout=5)
                if ready.status_code == 503:
                    break
                assert time.monotonic() < end
                time.sleep(0.02)
            assert ready.json()["reason"] == "draining"
            refused = httpx.post(url, timeout=30, json={"model": MODEL, "messages": MSGS})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            assert refused.headers["retry-after"] == "1"
            done = running.result()
        assert done.status_code == 200 and done.text.rstrip().endswith("data: [DONE]")
        assert narwhal.wait(20) == 0
    finally:
        stack.stop()
