"""Reading and normalising what vLLM and Narwhal answer, for side-by-side comparison.

Only values an engine stamps per request (``id``, ``created``, tool-call ids) are
normalised away; everything else must be equal.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import httpx
import orjson

TOOL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16}$")


def sse(client: httpx.Client, path: str, body: dict[str, Any],
        headers: dict[str, str] | None = None) -> tuple[int, list[Any]]:
    """POST a streaming request; return the status and its events (``"[DONE]"`` kept)."""
    events: list[Any] = []
    with client.stream("POST", path, json=body, headers=headers) as resp:
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            resp.read()
            return resp.status_code, [resp.json()]
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else orjson.loads(data))
    return resp.status_code, events


def normalise_events(events: list[Any]) -> list[Any]:
    out = []
    for event in events:
        if not isinstance(event, dict):
            out.append(event)
            continue
        event = copy.deepcopy(event)
        for key in ("id", "created"):
            event.pop(key, None)
        for choice in event.get("choices") or ():
            for call in (choice.get("delta") or {}).get("tool_calls") or ():
                if "id" in call:
                    assert TOOL_ID.match(call["id"]), call["id"]
                    call["id"] = "<tool-id>"
        out.append(event)
    return out


def shapes(events: list[Any]) -> set[tuple[frozenset[str], frozenset[str]]]:
    """Which top-level and choice keys the events use: the wire structure, blind to how the
    engine happened to batch tokens into events (vLLM merges tokens that queue up while its
    API server is busy, so event boundaries are timing, not format)."""
    out = set()
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices") or [{}]:
                out.add((frozenset(event), frozenset(choice)))
    return out


def usage_of(events: list[Any]) -> dict[str, Any] | None:
    for event in events:
        if isinstance(event, dict) and event.get("usage"):
            return event["usage"]
    return None


def core(resp: dict[str, Any]) -> dict[str, Any]:
    """The fields of a non-streaming response that Narwhal's assembly must reproduce."""
    usage = resp.get("usage") or {}
    choice = resp["choices"][0]
    out: dict[str, Any] = {
        "object": resp["object"], "model": resp["model"],
        "system_fingerprint": resp.get("system_fingerprint"),
        "usage": {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "prompt_token_ids": resp.get("prompt_token_ids"),
        "finish_reason": choice["finish_reason"], "stop_reason": choice.get("stop_reason"),
        "logprobs": choice.get("logprobs"), "token_ids": choice.get("token_ids"),
        "choice_prompt_token_ids": choice.get("prompt_token_ids"),
    }
    if "message" in choice:
        msg = choice["message"]
        out |= {"role": msg["role"], "content": msg.get("content"),
                "reasoning": msg.get("reasoning"), "refusal": msg.get("refusal"),
                "tool_calls": [(t["type"], t["function"]["name"], t["function"]["arguments"])
                               for t in msg.get("tool_calls") or []]}
        for call in msg.get("tool_calls") or []:
            assert TOOL_ID.match(call["id"]), call["id"]
    else:
        out["text"] = choice["text"]
    return out


def fold(events: list[Any], chat: bool, ids: bool) -> dict[str, Any]:
    """The test's own fold of a stream into :func:`core`'s shape (independent of Narwhal).

    ``ids``: the request asked for token IDs. vLLM's non-streaming answer has prompt IDs per
    completion choice only then, though its stream carries them with an echoed prompt."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, list[str]] = {}
    logprobs: Any = None
    out: dict[str, Any] = {"token_ids": None, "choice_prompt_token_ids": None,
                           "prompt_token_ids": None, "system_fingerprint": None, "usage": None}
    for event in events:
        if not isinstance(event, dict):
            continue
        out["system_fingerprint"] = event.get("system_fingerprint") or out["system_fingerprint"]
        if event.get("prompt_token_ids") is not None:
            out["prompt_token_ids"] = event["prompt_token_ids"]
        if event.get("usage"):
            out["usage"] = {k: event["usage"].get(k) for k in
                            ("prompt_tokens", "completion_tokens", "total_tokens")}
        for choice in event.get("choices") or ():
            if choice.get("token_ids") is not None:
                out["token_ids"] = (out["token_ids"] or []) + choice["token_ids"]
            if choice.get("prompt_token_ids") is not None and ids:
                out["choice_prompt_token_ids"] = choice["prompt_token_ids"]
            lp = choice.get("logprobs")
            if lp is not None:
                if logprobs is None:
                    logprobs = {k: list(v) if isinstance(v, list) else v for k, v in lp.items()}
                else:
                    for k, v in lp.items():
                        if isinstance(v, list):
                            logprobs[k] = (logprobs.get(k) or []) + v
            if choice.get("finish_reason") is not None:
                out["finish_reason"] = choice["finish_reason"]
                out["stop_reason"] = choice.get("stop_reason")
            if chat:
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning") or "")
                for call in delta.get("tool_calls") or ():
                    cur = calls.setdefault(call["index"], ["", ""])
                    fn = call.get("function") or {}
                    cur[0] += fn.get("name") or ""
                    cur[1] += fn.get("arguments") or ""
            else:
                content.append(choice.get("text") or "")
    out["logprobs"] = logprobs
    if chat:
        out["content"] = "".join(content) or ("" if calls else None)
        out["reasoning"] = "".join(reasoning) or None
        out["tool_calls"] = [("function", *calls[i]) for i in sorted(calls)]
    else:
        out["text"] = "".join(content)
    return out
