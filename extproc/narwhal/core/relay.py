"""Streaming pass-through: the engine's events in the engine's shape, minus what the
client did not ask for (token IDs, usage)."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


class Relay:
    __slots__ = ("expose_ids", "include_usage", "verbatim")

    def __init__(self, expose_ids: bool, include_usage: bool) -> None:
        self.expose_ids = expose_ids
        self.include_usage = include_usage
        self.verbatim = expose_ids and include_usage

    def event(self, event: dict[str, Any], raw: bytes) -> bytes | None:
        """Bytes to send the client for one engine event, or None to drop it."""
        if self.verbatim:
            return b"data: " + raw + b"\n\n"
        changed = False
        if not self.include_usage and "usage" in event:
            if not event.get("choices"):
                return None  # the usage-only frame Narwhal asked for, not the client
            del event["usage"]
            changed = True
        if not self.expose_ids:
            if "prompt_token_ids" in event:
                del event["prompt_token_ids"]
                changed = True
            for choice in event.get("choices", ()):
                if "token_ids" in choice:
                    del choice["token_ids"]
                    changed = True
        return b"data: " + (orjson.dumps(event) if changed else raw) + b"\n\n"
