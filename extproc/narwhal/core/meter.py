"""Per-exchange measurement of the engine's output: token identity, counts, first token.

One meter sees every decoded engine event before the relay or the assembler does, so
output accounting is identical for streaming and non-streaming clients.

With token IDs, every ID an engine sends is an output token, whether or not its event
shows text: vLLM sends events with an empty delta for tokens that a tool or reasoning
parser swallows, for partial UTF-8 and for skipped special tokens. The seed's check
stays on top: an event that does carry generated output must carry a valid ID list.
Without IDs (dialect ``openai``, or a request whose IDs the engine cannot return), the
meter counts generating events and, at the end, trusts the engine's own usage.
"""

from __future__ import annotations

from typing import Any

from . import jsontext
from .tokens import TokenIdError, carries_generation, count_token_ids


class EngineOutputError(ValueError):
    """Engine output Narwhal cannot accept: malformed, unsupported, or an error event."""


class EngineErrorEvent(EngineOutputError):
    """The engine sent an error event (``data: {"error": ...}``) inside its stream."""

    def __init__(self, error: Any, raw: bytes) -> None:
        msg = error.get("message") if isinstance(error, dict) else error
        super().__init__(f"engine reported an error mid-stream: {msg}")
        self.error = error
        self.raw = raw

    @property
    def status(self) -> int:
        """The HTTP status the engine would answer without a stream: its error's code."""
        code = self.error.get("code") if isinstance(self.error, dict) else None
        return code if code.__class__ is int and 400 <= code <= 599 else 502


MAX_USAGE_FIELDS = 64  # vLLM's usage has four


def _usage(usage: Any) -> dict[str, Any]:
    """The engine's usage as kept until the response ends: its numbers as they are (the
    counts read), its objects as JSON text (``prompt_tokens_details``, read by nobody).
    Parsed, one 1 MiB event's usage would hold ~10 MiB through the response."""
    if usage.__class__ is not dict:
        raise EngineOutputError("engine usage is not an object")
    if len(usage) > MAX_USAGE_FIELDS:
        raise EngineOutputError(f"engine usage has more than {MAX_USAGE_FIELDS} fields")
    for value in usage.values():
        if value.__class__ is dict or value.__class__ is list:
            try:
                return {k: jsontext.held(v)[0] for k, v in usage.items()}
            except TypeError:
                raise EngineOutputError("engine usage nested deeper than 254 levels") from None
    return usage


# Events that carry no output (no token, no text): an answer has a few (the role event,
# the finish_reason's, usage), and each costs ~1-2 us to parse, check and relay (4 MiB of
# ``{"choices":[]}`` events after a token cost 0.25-0.38 s in process, relayed whole to a
# streaming client). Past FREE_EMPTY_EVENTS of them an answer fails. Counted as events
# less output tokens, checked only on an event without output: nothing is added to a
# token event's path (and events of several tokens each leave room for more).
FREE_EMPTY_EVENTS = 1024


class Meter:
    __slots__ = ("chat", "token_ids", "counted", "events", "first_token_seen", "usage",
                 "prompt_token_ids", "finished", "done", "cap")

    def __init__(self, chat: bool, token_ids: bool, max_tokens: int | None = None) -> None:
        self.chat = chat
        self.token_ids = token_ids
        # Counted IDs are exact, so more than the request's max_tokens is an engine that
        # broke it (vLLM stops at it, speculative tokens included): without this, a
        # runaway stream held its decode slot, and its client, for as long as it ran.
        self.cap = max_tokens if token_ids and max_tokens is not None else 1 << 62
        self.counted = 0
        self.events = 0
        self.first_token_seen = False
        self.usage: dict[str, Any] | None = None
        self.prompt_token_ids: int | None = None
        self.finished = False  # a choice carried its finish_reason
        self.done = False  # the engine sent ``[DONE]`` (the exchange tells it)

    @property
    def output_tokens(self) -> int:
        """Measured output length: counted IDs; without IDs, the engine's usage if it sent one."""
        if not self.token_ids and self.usage is not None:
            reported = self.usage.get("completion_tokens")
            if reported.__class__ is int and reported >= 0:
                return reported
        return self.counted

    def observe(self, event: Any, raw: bytes = b"") -> int:
        """Validate one decoded event; return how many output tokens it carried."""
        if event.__class__ is not dict:
            raise EngineOutputError("engine event is not a JSON object")
        if "error" in event:
            raise EngineErrorEvent(event["error"], raw)
        choices = event.get("choices")
        if choices.__class__ is not list:
            raise EngineOutputError("engine event has no choices array")
        usage = event.get("usage")
        if usage is not None:
            self.usage = _usage(usage)
        if self.prompt_token_ids is None:
            self._prompt_ids(event.get("prompt_token_ids"))
        tokens = 0
        for choice in choices:
            if choice.__class__ is not dict:
                raise EngineOutputError("engine choice is not an object")
            if choice.get("finish_reason") is not None:
                self.finished = True
            if self.prompt_token_ids is None and not self.chat:
                self._prompt_ids(choice.get("prompt_token_ids"))  # completions: per choice
            if self.token_ids:
                ids = choice.get("token_ids")
                if ids is not None:
                    tokens += count_token_ids(ids)
                elif carries_generation(choice, self.chat):
                    raise TokenIdError("engine event carries generated output without token_ids")
            elif carries_generation(choice, self.chat):
                tokens += 1
        if tokens:
            self.first_token_seen = True
            self.counted += tokens
            if self.counted > self.cap:
                raise TokenIdError(f"engine sent {self.counted} output token IDs, past the "
                                   f"request's max_tokens ({self.cap})")
        elif self.events - self.counted >= FREE_EMPTY_EVENTS:
            raise EngineOutputError(f"engine sent over {FREE_EMPTY_EVENTS} events without output")
        self.events += 1
        return tokens

    @property
    def whole(self) -> bool:
        """The engine's answer ended as an engine ends one: with ``[DONE]``, or at least
        with its choice's finish_reason (a request has one choice). A stream that ends
        without either was cut short (an engine that died behind a close-delimited body,
        a proxy that ended a chunked body on its own timeout) and is no completion."""
        return self.done or self.finished

    def _prompt_ids(self, ids: Any) -> None:
        if ids.__class__ is list:
            self.prompt_token_ids = len(ids)


__all__ = ["EngineErrorEvent", "EngineOutputError", "Meter", "TokenIdError"]
