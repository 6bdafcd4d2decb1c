"""Per-exchange measurement of the engine's output: token identity, counts, first token.

One meter sees every decoded engine event before the relay or the assembler does, so
output accounting is identical for streaming and non-streaming clients.
"""

from __future__ import annotations

from typing import Any

from .tokens import TokenIdError, carries_generation, count_token_ids


class EngineOutputError(ValueError):
    """Engine output Narwhal cannot accept: malformed, unsupported, or an error event."""


class Meter:
    __slots__ = ("chat", "token_ids", "output_tokens", "events", "first_token_seen", "usage",
                 "prompt_token_ids")

    def __init__(self, chat: bool, token_ids: bool) -> None:
        self.chat = chat
        self.token_ids = token_ids
        self.output_tokens = 0
        self.events = 0
        self.first_token_seen = False
        self.usage: dict[str, Any] | None = None
        self.prompt_token_ids: int | None = None

    def observe(self, event: Any) -> int:
        """Validate one decoded event; return how many output tokens it carried."""
        if event.__class__ is not dict:
            raise EngineOutputError("engine event is not a JSON object")
        if "error" in event:
            err = event["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise EngineOutputError(f"engine reported an error mid-stream: {msg}")
        choices = event.get("choices")
        if choices.__class__ is not list:
            raise EngineOutputError("engine event has no choices array")
        usage = event.get("usage")
        if usage is not None:
            if not isinstance(usage, dict):
                raise EngineOutputError("engine usage is not an object")
            self.usage = usage
        ptids = event.get("prompt_token_ids")
        if ptids is not None and self.prompt_token_ids is None and isinstance(ptids, list):
            self.prompt_token_ids = len(ptids)
        tokens = 0
        for choice in choices:
            if choice.__class__ is not dict:
                raise EngineOutputError("engine choice is not an object")
            if not carries_generation(choice, self.chat):
                if self.token_ids and choice.get("token_ids") is not None:
                    count_token_ids(choice)  # still reject Booleans and malformed lists
                continue
            if self.token_ids:
                tokens += count_token_ids(choice)
            else:
                tokens += 1
        if tokens:
            self.first_token_seen = True
            self.output_tokens += tokens
        self.events += 1
        return tokens


__all__ = ["EngineOutputError", "Meter", "TokenIdError"]
