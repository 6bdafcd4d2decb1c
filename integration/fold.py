"""The test's own fold of an openai stream, written independently of Narwhal's assembler,
so that the two can be compared field by field."""

from __future__ import annotations

from typing import Any


def fold_chat(chunks: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"content": None, "reasoning": None, "reasoning_content": None,
                           "refusal": None, "tool_calls": {}, "function_call": None,
                           "logprobs_content": None, "logprobs_refusal": None,
                           "finish_reason": None, "stop_reason": None, "usage": None,
                           "id": None, "token_ids": [], "events": 0}
    for chunk in chunks:
        out["id"] = out["id"] or chunk.id
        if chunk.usage is not None:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            out["events"] += 1
            delta = choice.delta.model_dump()
            for key in ("content", "reasoning", "reasoning_content", "refusal"):
                if delta.get(key):
                    out[key] = (out[key] or "") + delta[key]
            for tc in delta.get("tool_calls") or []:
                cur = out["tool_calls"].setdefault(tc["index"], {"id": "", "name": "",
                                                                 "arguments": ""})
                cur["id"] += tc.get("id") or ""
                fn = tc.get("function") or {}
                cur["name"] += fn.get("name") or ""
                cur["arguments"] += fn.get("arguments") or ""
            fc = delta.get("function_call")
            if fc:
                cur = out["function_call"] = out["function_call"] or {"name": "", "arguments": ""}
                cur["name"] += fc.get("name") or ""
                cur["arguments"] += fc.get("arguments") or ""
            if choice.logprobs is not None:
                lp = choice.logprobs.model_dump()
                for key in ("content", "refusal"):
                    if lp.get(key) is not None:
                        out[f"logprobs_{key}"] = (out[f"logprobs_{key}"] or []) + lp[key]
            extra = choice.model_extra or {}
            out["token_ids"] += extra.get("token_ids") or []
            if choice.finish_reason is not None:
                out["finish_reason"] = choice.finish_reason
                out["stop_reason"] = extra.get("stop_reason")
    out["tool_calls"] = [out["tool_calls"][k] for k in sorted(out["tool_calls"])]
    if out["tool_calls"] and out["content"] is None:
        out["content"] = ""  # vLLM's non-streaming message beside tool calls
    return out


def assembled_chat(resp: Any) -> dict[str, Any]:
    """The same shape, read from an assembled ChatCompletion."""
    choice = resp.choices[0]
    msg = choice.message.model_dump()
    extra = choice.model_extra or {}
    lp = choice.logprobs.model_dump() if choice.logprobs is not None else {}
    return {
        "content": msg.get("content"), "reasoning": msg.get("reasoning"),
        "reasoning_content": msg.get("reasoning_content"), "refusal": msg.get("refusal"),
        "tool_calls": [{"id": t["id"], "name": t["function"]["name"],
                        "arguments": t["function"]["arguments"]}
                       for t in msg.get("tool_calls") or []],
        "function_call": msg.get("function_call"),
        "logprobs_content": lp.get("content"), "logprobs_refusal": lp.get("refusal"),
        "finish_reason": choice.finish_reason, "stop_reason": extra.get("stop_reason"),
        "usage": resp.usage.model_dump() if resp.usage else None, "id": resp.id,
        "token_ids": extra.get("token_ids") or [],
    }
