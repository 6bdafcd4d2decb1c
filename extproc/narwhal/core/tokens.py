"""Token identity: which events must carry token IDs, and what a valid ID list is.

The seed is strict: an event carrying generated text, reasoning, tool calls or a
refusal must carry a list of non-negative integers. Python's ``bool`` is an ``int``
subclass, so Booleans are rejected explicitly.
"""

from __future__ import annotations

from typing import Any

GENERATED_DELTA_KEYS = frozenset({"content", "reasoning", "reasoning_content", "refusal",
                                  "tool_calls", "function_call"})


class TokenIdError(ValueError):
    """The engine broke the token-identity contract on an event."""


def carries_generation(choice: dict[str, Any], chat: bool) -> bool:
    if not chat:
        return bool(choice.get("text"))
    delta = choice.get("delta")
    if delta.__class__ is not dict:
        return False
    # Deltas hold one or two keys: scan them, not the set; a plain loop, no generator.
    for key, value in delta.items():  # noqa: SIM110
        if value and key in GENERATED_DELTA_KEYS:
            return True
    return False


def count_token_ids(choice: dict[str, Any]) -> int:
    ids = choice.get("token_ids")
    if ids is None:
        raise TokenIdError("engine event carries generated output without token_ids")
    if not isinstance(ids, list):
        raise TokenIdError("engine event has a malformed token_ids list")
    for tid in ids:
        if tid.__class__ is not int or tid < 0:
            if isinstance(tid, bool):
                raise TokenIdError("engine event has a Boolean token ID")
            raise TokenIdError(f"engine event has an invalid token ID {tid!r}")
    return len(ids)
