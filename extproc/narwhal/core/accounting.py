"""Request accounting: offered arrivals and exactly one terminal class per request.

Plain integers, read by a Prometheus collector at scrape time, so the hot path pays
for an integer increment rather than a metric-library call.

``in_flight`` is counted on its own (up when a request is offered, down when its
exchange ends), not derived as offered minus terminals: the invariant
offered = Σ terminal + in_flight can then fail, and a request that leaks (never
reaches a terminal class) shows as in flight forever instead of vanishing.
"""

from __future__ import annotations

from .errors import TERMINAL_CLASSES


class Accounting:
    __slots__ = ("offered", "unsized_offered", "terminal", "in_flight")

    def __init__(self) -> None:
        self.offered = 0
        self.unsized_offered = 0
        self.in_flight = 0
        self.terminal = dict.fromkeys(TERMINAL_CLASSES, 0)

    def offer(self) -> None:
        self.offered += 1
        self.in_flight += 1

    def end(self, terminal: str) -> None:
        self.terminal[terminal] += 1
        self.in_flight -= 1

    def balanced(self) -> bool:
        return self.offered == sum(self.terminal.values()) + self.in_flight
