"""Request accounting: offered arrivals and exactly one terminal class per request.

Plain integers, read by a Prometheus collector at scrape time, so the hot path pays
for an integer increment rather than a metric-library call.
"""

from __future__ import annotations

from .errors import TERMINAL_CLASSES


class Accounting:
    __slots__ = ("offered", "unsized_offered", "terminal")

    def __init__(self) -> None:
        self.offered = 0
        self.unsized_offered = 0
        self.terminal = dict.fromkeys(TERMINAL_CLASSES, 0)

    @property
    def in_flight(self) -> int:
        return self.offered - sum(self.terminal.values())
