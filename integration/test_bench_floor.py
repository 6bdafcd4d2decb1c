"""The data-path benchmark's floor (``bench.null_extproc`` behind the shipped Envoy
config) serves the same messages as Narwhal: its figures are only a floor if it does."""

from __future__ import annotations

import httpx
import orjson
from bench.datapath import null_path

from narwhal.launch import SimSpec

from .conftest import MODEL


def test_the_null_processor_relays_a_streamed_answer_for_either_kind_of_request(tmp_path):
    route = null_path(SimSpec("instant"), tmp_path)
    try:
        for stream in (False, True):
            # As the benchmark's wrk sends it: compact JSON.
            body = orjson.dumps({"model": MODEL, "max_tokens": 16, "stream": stream,
                                 "messages": [{"role": "user", "content": "hello there"}]})
            resp = httpx.post(f"{route.url}/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=10)
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            ids = [i for e in events[:-1] for c in orjson.loads(e)["choices"]
                   for i in c.get("token_ids") or []]
            text = "".join(c["delta"].get("content") or "" for e in events[:-1]
                           for c in orjson.loads(e)["choices"])
            assert text and not ids  # the engine's stream, untouched: no IDs were asked for
    finally:
        route.stop()
