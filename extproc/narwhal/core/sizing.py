"""Workload sizing: how many prompt tokens a request will prefill.

By default from prompt bytes: engines report ``usage.prompt_tokens`` for every
request, and the byte/token ratio is an EWMA of what they report, so projections
follow the model's real tokenizer without Narwhal loading one. With
``sizing.tokenizer`` set, the model's own tokenizer file counts the prompt text.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .prefix import BLOCK_BYTES, BLOCK_TOKENS
from .tokens import encode

EWMA = 0.1
# A prompt longer than this is tokenized off the event loop (``Exchange.measure``): ~1-3
# ms of a tokenizer's work here, where a thread's hand-off costs tens of microseconds.
OFFLOAD_BYTES = 4096


class SizingError(ValueError):
    pass


class Sizer:
    __slots__ = ("bytes_per_token", "samples", "tokenizer")

    def __init__(self, bytes_per_token: float, tokenizer_path: str = "") -> None:
        self.bytes_per_token = bytes_per_token
        self.samples = 0
        self.tokenizer = _load_tokenizer(tokenizer_path) if tokenizer_path else None

    def estimate(self, prompt_bytes: int, text: Callable[[], str] | None = None) -> int:
        """Prompt tokens; ``text`` is called only when a tokenizer is configured."""
        if self.tokenizer is not None and text is not None:
            return max(1, len(encode(self.tokenizer, text())))
        return max(1, math.ceil(prompt_bytes / self.bytes_per_token))

    def offloads(self, prompt_bytes: int) -> bool:
        """Whether a prompt this long is tokenized off the event loop: only with a
        tokenizer (without one, sizing is arithmetic) and past ``OFFLOAD_BYTES``."""
        return self.tokenizer is not None and prompt_bytes > OFFLOAD_BYTES

    def tokens_per_block(self) -> float:
        """Tokens one prefix-index block covers: 16 with a tokenizer, else 64 bytes'
        worth at the learned ratio."""
        if self.tokenizer is not None:
            return float(BLOCK_TOKENS)
        return BLOCK_BYTES / max(0.5, self.bytes_per_token)

    def learn(self, prompt_bytes: int, prompt_tokens: object) -> None:
        if not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool):
            return  # engine output is not trusted
        if prompt_tokens <= 0 or prompt_bytes < 64:
            return  # chat templates dominate tiny prompts
        ratio = prompt_bytes / prompt_tokens
        if 0.5 <= ratio <= 32:
            self.bytes_per_token += EWMA * (ratio - self.bytes_per_token)
            self.samples += 1


def _load_tokenizer(path: str):  # returns a tokenizers.Tokenizer (an optional dependency)
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise SizingError("sizing.tokenizer needs the `tokenizers` package "
                          "(pip install 'narwhal[tokenizer]')") from exc
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the library raises a bare Exception on bad files
        raise SizingError(f"sizing.tokenizer: cannot load {path}: {exc}") from exc
