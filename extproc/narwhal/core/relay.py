"""Streaming pass-through: the engine's events in the engine's shape, minus what the
client did not ask for (token IDs, usage).

What the client did not ask for is made to look the way vLLM answers a client that did
not ask: ID fields become ``null`` rather than vanish, events that only carried token IDs
(an empty delta: tool-call markup, partial UTF-8) are dropped, and the usage frame's
metadata (``system_fingerprint``) moves onto the final choice event, which is held
back until the usage frame that follows it arrives.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
ID_FIELDS = ("token_ids", "prompt_token_ids")


def _frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class Relay:
    __slots__ = ("expose_ids", "include_usage", "verbatim", "held")

    def __init__(self, expose_ids: bool, include_usage: bool) -> None:
        self.expose_ids = expose_ids
        self.include_usage = include_usage
        self.verbatim = expose_ids and include_usage
        self.held: dict[str, Any] | None = None

    def event(self, event: dict[str, Any], raw: bytes) -> bytes | None:
        """Bytes to send the client for one engine event, or None to send nothing (yet)."""
        if self.verbatim:
            return _frame(raw)
        choices = event.get("choices") or ()
        if not self.include_usage and "usage" in event and not choices:
            return self._usage_frame(event)
        changed = False
        if not self.include_usage and "usage" in event:
            del event["usage"]
            changed = True
        if not self.expose_ids:
            if event.get("prompt_token_ids") is not None:
                event["prompt_token_ids"] = None
                changed = True
            ids_only = bool(choices)
            for choice in choices:
                for key in ID_FIELDS:
                    if choice.get(key) is not None:
                        choice[key] = None
                        changed = True
                ids_only = ids_only and _ids_only(choice)
            if ids_only and changed:
                return None
        if not self.include_usage and any(c.get("finish_reason") is not None for c in choices):
            out = self.flush()
            self.held = event
            return out
        return _frame(orjson.dumps(event) if changed else raw)

    def _usage_frame(self, event: dict[str, Any]) -> bytes | None:
        """The usage-only frame Narwhal asked for, not the client: keep its metadata only."""
        held = self.held
        if held is None:
            return None
        for key, value in event.items():
            if key not in ("usage", "choices", "id", "object", "created", "model") \
                    and value is not None:
                held.setdefault(key, value)
        return self.flush()

    def flush(self) -> bytes | None:
        """Release the held final event (the stream ends, or another event follows)."""
        held, self.held = self.held, None
        return None if held is None else _frame(orjson.dumps(held))


def _ids_only(choice: dict[str, Any]) -> bool:
    """A chat event that carried nothing but token IDs once they are gone (vLLM sends such
    an event, ``delta: {}``, only to a client that asked for IDs)."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    delta = choice.get("delta")  # completions' empty-text events vLLM sends all the same
    return delta is not None and not any(v is not None for v in delta.values())
