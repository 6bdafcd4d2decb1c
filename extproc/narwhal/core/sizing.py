"""Workload sizing: prompt tokens from prompt bytes, with the ratio learned from engines.

Engines report ``usage.prompt_tokens`` for every request; the byte/token ratio is an
EWMA of what they report, so projections follow the model's real tokenizer without
Narwhal loading one.
"""

from __future__ import annotations

import math

EWMA = 0.1


class Sizer:
    __slots__ = ("bytes_per_token", "samples")

    def __init__(self, bytes_per_token: float) -> None:
        self.bytes_per_token = bytes_per_token
        self.samples = 0

    def estimate(self, prompt_bytes: int) -> int:
        return max(1, math.ceil(prompt_bytes / self.bytes_per_token))

    def learn(self, prompt_bytes: int, prompt_tokens: object) -> None:
        if not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool):
            return  # engine output is not trusted
        if prompt_tokens <= 0 or prompt_bytes < 64:
            return  # chat templates dominate tiny prompts
        ratio = prompt_bytes / prompt_tokens
        if 0.5 <= ratio <= 32:
            self.bytes_per_token += EWMA * (ratio - self.bytes_per_token)
            self.samples += 1
