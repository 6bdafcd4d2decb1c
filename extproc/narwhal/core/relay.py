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

from .meter import EngineOutputError

DONE = b"data: [DONE]\n\n"


def _frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def _written(event: dict[str, Any]) -> bytes:
    """An event changed for the client, as JSON."""
    try:
        return orjson.dumps(event)
    except orjson.JSONEncodeError:
        raise _too_deep() from None


def _too_deep() -> EngineOutputError:
    """orjson reads 1,024 levels of nesting and writes 254: an event nested between them
    is the engine's malformed output (not a fault of Narwhal's, a 500, as it was)."""
    return EngineOutputError("engine event nested deeper than 254 levels")


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
        include_usage = self.include_usage
        if not include_usage and "usage" in event:
            if not choices:
                return self._usage_frame(event)
            del event["usage"]
            changed = True
        else:
            changed = False
        hide = not self.expose_ids
        if hide and event.get("prompt_token_ids") is not None:
            event["prompt_token_ids"] = None
            changed = True
        ids_only = hide
        final = False
        # One plain loop per choice (events hold one): this runs for every token.
        for choice in choices:
            if choice.get("finish_reason") is not None:
                final = True
                ids_only = False
            if hide:
                if choice.get("token_ids") is not None:
                    choice["token_ids"] = None
                    changed = True
                else:
                    ids_only = False
                if "prompt_token_ids" in choice and choice["prompt_token_ids"] is not None:
                    choice["prompt_token_ids"] = None
                    changed = True
                # vLLM sends a tool parser's swallowed tokens as ``delta: {}`` with IDs,
                # and nothing at all to a client that did not ask for IDs.
                if ids_only and (choice.get("delta") or choice.get("logprobs") is not None
                                 or "delta" not in choice):
                    ids_only = False
        if ids_only and choices:
            return None
        if final and not include_usage:
            out = self.flush()
            self.held = event
            return out
        if changed:
            try:  # inline: this runs for every token event a client gets without its IDs
                raw = orjson.dumps(event)
            except orjson.JSONEncodeError:
                raise _too_deep() from None
        return _frame(raw)

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
        return None if held is None else _frame(_written(held))
