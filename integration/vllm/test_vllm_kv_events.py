"""Precise prefix-cache matching against real vLLM: Narwhal subscribes to the engine's
KV-cache events (ZMQ) and computes each prompt's token IDs with the model's chat
template; the prompt tokens it predicts cached must be the ones vLLM reports cached."""

from __future__ import annotations

import re
import uuid

import httpx

from ..conftest import wait_for
from .conftest import Pair
from .engine import SERVED_MODEL

CHAT = "/v1/chat/completions"


def _ask(pair: Pair, system: str, user: str) -> tuple[int, int, int]:
    """(Narwhal's predicted cached prompt tokens, vLLM's cached, prompt tokens)."""
    with pair.routed() as c:
        r = c.post(CHAT, json={"model": SERVED_MODEL, "max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(r.headers["x-narwhal-predicted-cached-tokens"]), cached, usage["prompt_tokens"]


def test_predicted_cached_tokens_are_the_engines_own(kv_pair):
    system = f"You are a careful assistant {uuid.uuid4()} who answers in verse. " * 16
    predicted, cached, prompt = _ask(kv_pair, system, "what is a cat")
    assert predicted == cached == 0 and prompt > 256  # a new prompt: nothing cached

    def stored() -> dict | None:
        st = kv_pair.engine_status()
        kv = st["kv_events"]
        return st if kv["batches"] >= 1 and kv["blocks"] >= 2 and kv["live"] else None

    st = wait_for(stored)  # the engine published the prompt's blocks
    assert st["prefix_source"] == "kv-events" and st["kv_events"]["errors"] == 0
    metrics = httpx.get(f"{kv_pair.stack.admin_url}/metrics", timeout=5).text
    name = st["name"]
    assert f'narwhal_engine_kv_events_live{{engine="{name}"}} 1.0' in metrics
    assert f'narwhal_engine_kv_event_errors_total{{engine="{name}"}} 0.0' in metrics
    blocks = re.search(rf'narwhal_engine_kv_event_blocks{{engine="{name}"}} (\S+)', metrics)
    assert blocks is not None and float(blocks.group(1)) >= 2
    block = st["kv_events"]["block_size"]
    for user in ("what is a dog", "what is a bird"):
        predicted, cached, prompt = _ask(kv_pair, system, user)
        assert cached >= 2 * block  # the shared system prompt's whole blocks
        assert predicted == cached  # exactly what vLLM found in its cache
    # A prompt the engine never saw: nothing predicted, nothing found.
    predicted, cached, _ = _ask(kv_pair, f"Another {uuid.uuid4()} preamble. " * 30, "hi")
    assert predicted == cached == 0
