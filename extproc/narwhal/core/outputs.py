"""Output-length learning: how many tokens a request will generate, predicted from what
is known at admission, learned from identified output.

Why: decode load is what a request's output costs an engine for as long as it runs;
max_tokens says little (clients send 1024 and get 60). Requests of one application
(one system prompt) and one shape answer alike, so the features are the route, the
system prompt's hash, max_tokens and the prompt size (both in powers of two). The
prediction comes from the most specific combination seen often enough, backing off to
coarser ones; every completion updates all of them. Memory is bounded (LRU).
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from typing import Any

from .prediction_error import ErrorWindow

MAX_KEYS = 4096
MIN_SAMPLES = 3
EWMA = 0.1
ERROR_WINDOW = 2048

Key = tuple[Any, ...]


def _bucket(n: int | None) -> int:
    return 0 if not n or n <= 0 else int(math.log2(n)) + 1


def system_hash(body: dict[str, Any]) -> int:
    """The first message's content when it is a system (or developer) message."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
        return 0
    first = messages[0]
    if first.get("role") not in ("system", "developer"):
        return 0
    content = first.get("content")
    if isinstance(content, str):
        return zlib.crc32(content.encode())
    return zlib.crc32(repr(content).encode())


class OutputLengths:
    def __init__(self, default: float = 128.0) -> None:
        self.default = default
        self.stats: OrderedDict[Key, list[float]] = OrderedDict()  # key -> [mean, n]
        self.errors = ErrorWindow(ERROR_WINDOW)

    @staticmethod
    def keys(chat: bool, system: int, max_tokens: int | None, prompt_tokens: int) -> list[Key]:
        route = "chat" if chat else "text"
        mt, pt = _bucket(max_tokens), _bucket(prompt_tokens)
        return [(route, system, mt, pt), (route, system, mt), (route, system), (route,)]

    def predict(self, keys: list[Key], max_tokens: int | None) -> int:
        guess = self.default
        for key in keys:
            s = self.stats.get(key)
            if s is not None and s[1] >= MIN_SAMPLES:
                guess = s[0]
                break
        n = max(1, round(guess))
        return min(n, max_tokens) if max_tokens else n

    def learn(self, keys: list[Key], predicted: int, actual: int) -> None:
        if actual <= 0:
            return
        self.errors.add(abs(predicted - actual) / actual)
        for key in keys:
            s = self.stats.get(key)
            if s is None:
                self.stats[key] = [float(actual), 1.0]
                if len(self.stats) > MAX_KEYS:
                    self.stats.popitem(last=False)
            else:
                s[1] += 1
                s[0] += max(EWMA, 1 / s[1]) * (actual - s[0])
                self.stats.move_to_end(key)

    def error_summary(self) -> dict[str, float | int | None]:
        return self.errors.summary()
