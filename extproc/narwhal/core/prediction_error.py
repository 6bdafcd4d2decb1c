"""How far predictions ran from what was measured: a window of relative errors.

Why one class: the TTFT projection (pool-wide and per engine) and the output-length
prediction are judged the same way, ``|predicted - actual| / actual`` over recent
requests, and an operator reads them side by side: on ``/status`` as p50, p90 and mean
(MAPE) of the window, on ``/metrics`` as a summary whose lifetime ``_sum / _count`` is
the mean and whose quantiles are the window's.
"""

from __future__ import annotations

import math
from collections import deque


class ErrorWindow:
    __slots__ = ("recent", "count", "total")

    def __init__(self, window: int) -> None:
        self.recent: deque[float] = deque(maxlen=window)
        self.count = 0  # errors ever recorded (the summary's _count)
        self.total = 0.0  # and their sum (its _sum)

    def add(self, error: float) -> None:
        self.recent.append(error)
        self.count += 1
        self.total += error

    def __len__(self) -> int:
        return len(self.recent)

    def quantiles(self, *qs: float) -> list[float]:
        """The window's quantiles (nearest rank below), in the order asked; empty: none."""
        xs = sorted(self.recent)
        return [xs[min(len(xs) - 1, math.floor(q * len(xs)))] for q in qs] if xs else []

    def summary(self) -> dict[str, float | int | None]:
        if not self.recent:
            return {"p50": None, "p90": None, "mape": None, "samples": 0}
        p50, p90 = self.quantiles(0.5, 0.9)
        return {"p50": round(p50, 4), "p90": round(p90, 4),
                "mape": round(sum(self.recent) / len(self.recent), 4),
                "samples": len(self.recent)}
