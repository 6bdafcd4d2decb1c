"""Admission's margin per engine: how far measured TTFT runs over the projection, by the
size of the projection.

Why by size. A projection is wrong in two ways at once: by a share (the model's slope
is a little off) and by a step or two (a request arriving mid-step waits out the step;
its prefill lands in whichever step has room). For a short projection the second
dominates: 50 ms projected and 120 ms measured is a ratio of 2.4, harmless against a
1 s budget. One p99 ratio over all requests is then set by the shortest ones, and every
request projected at a third of the budget or more is refused, on an engine that would
have served it in time (measured: ~35% refused at 1.0x load against a pool that a
router without admission serves 98% in budget). So the ratios are kept per octave of
the projection, and a request is judged by the p99 of its own octave, where the margin
that matters (projections near the budget) is learned from requests like it.

An octave with too few samples borrows a neighbour's margin: the nearest of the two
shorter octaves that has one (its ratios run higher: the borrowed margin errs on the
safe side), else the nearest longer one, else the p99 of the few samples there are from
two octaves below upwards, else the pool's margin for that size (the same rules over
every engine's samples: an engine that has served nothing near this size yet, such as
one that only just became busy, is presumed as far off as the pool's others have been,
not exact), else 1.0 (the model's own projection, as before any measurement). Never
from further below: a 20 ms projection measured at 35 ms (a
scheduling hiccup of the proxy's host) says nothing of a 0.6 s one, and pooled with it
refused 0.6 s requests that were measured within 2% of their projection. Projections
under 10 ms are not learned from at all, for the same reason.
"""

from __future__ import annotations

import math
from collections import deque

QUANTILE = 0.99  # the promise is kept for 99% of admitted requests
MAX_FACTOR = 10.0
WINDOW = 128  # ratios kept per octave
MIN_SAMPLES = 16  # before an octave's own margin is used
LOWEST = -10  # octave of 2**-10 s (~1 ms) and below
OCTAVES = 20  # up to 2**9 s (~8.5 min) and above
BORROW_BELOW = 2  # octaves below whose margin an octave without its own may borrow
MIN_PREDICTED_S = 0.01  # shorter projections are the proxy's latency, not the engine's


def _octave(predicted_s: float) -> int:
    if predicted_s <= 0:
        return 0
    return min(OCTAVES - 1, max(0, math.floor(math.log2(predicted_s)) - LOWEST))


def _quantile(xs: deque[float]) -> float:
    s = sorted(xs)
    return min(MAX_FACTOR, max(1.0, s[min(len(s) - 1, int(QUANTILE * len(s)))]))


class Calibration:
    """Measured/predicted TTFT ratios of one engine, by octave of the prediction."""

    __slots__ = ("_ratios", "_factors", "_pooled", "_all", "_seen", "_total", "_top",
                 "overall", "pool", "epoch")

    def __init__(self, pool: Calibration | None = None) -> None:
        self.pool = pool  # every engine's samples: the margin where this one has none
        self.epoch = 0  # clears so far: a projection made before the last one is no sample
        self._empty()

    def _empty(self) -> None:
        self._ratios: list[deque[float]] = [deque(maxlen=WINDOW) for _ in range(OCTAVES)]
        self._factors: list[float | None] = [None] * OCTAVES  # own p99 once MIN_SAMPLES
        # per octave, the p99 of the samples from two octaves below upwards: computed
        # when first asked for, forgotten every fourth sample
        self._pooled: list[float | None] = [None] * OCTAVES
        self._all: deque[float] = deque(maxlen=2 * WINDOW)
        self._seen = [0] * OCTAVES  # samples ever, per octave (the recompute cadence)
        self._total = 0
        # The highest octave holding samples (-1: none). Why: a margin is asked per engine
        # per decision, and an engine with nothing at or above a projection's octaves (a
        # new one; every one, while projections are under MIN_PREDICTED_S) walked all
        # twenty octaves twice, its own and the pool's, for 1.0: ~4 us an engine, 270 us
        # a request in a pool of 64 (measured in process).
        self._top = -1
        self.overall = 1.0  # the p99 over every recent sample (the fallback; /status)

    def clear(self) -> None:
        """Forget every ratio: they measured a model the engine no longer has (its model
        was reopened, and it is profiled again). Why: kept, the ratios of the requests that
        showed a drift set the octave's p99 until 128 newer samples of that octave replace
        them, and an octave the engine's projections no longer reach keeps them for good
        (measured: an h100 halved in speed kept factors of 2.9 and 3.1, one for the whole
        run, the other for the ~24 s its new projections took to fill the octave anew.
        Until its octaves have their own again it borrows the pool's. The requests
        projected before the clear teach it nothing (``epoch``): in that run the ones
        still in flight while the engine was profiled again put 13 ratios near 3x into
        an octave that had 9.)"""
        self._empty()
        self.epoch += 1

    def observe(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s < MIN_PREDICTED_S:
            return
        ratio = measured_s / predicted_s
        i = _octave(predicted_s)
        xs = self._ratios[i]
        xs.append(ratio)
        if i > self._top:
            self._top = i
        self._all.append(ratio)
        self._seen[i] += 1
        self._total += 1
        # Sorting is per sample of the engine, not per decision: every fourth one (the
        # first few samples count at once: until an octave has its own margin, they are
        # all the evidence there is).
        if len(xs) >= MIN_SAMPLES and self._seen[i] % 4 == 0:
            self._factors[i] = _quantile(xs)
        if self._total % 4 == 0 or self._total < MIN_SAMPLES:
            self.overall = _quantile(self._all)
            self._pooled = [None] * OCTAVES

    def factor(self, predicted_s: float) -> float:
        """The margin for a projection of ``predicted_s``: its octave's p99 ratio, or a
        neighbour's (two shorter, then longer ones), or the p99 of the samples near and
        above it, or 1.0."""
        own = _octave(predicted_s)
        lowest = max(0, own - BORROW_BELOW)
        for i in range(own, lowest - 1, -1):
            f = self._factors[i]
            if f is not None:
                return f
        top = self._top
        for i in range(own + 1, top + 1):  # (no octave above the top has a margin)
            f = self._factors[i]
            if f is not None:
                return f
        if top < lowest:  # nothing near or above: the pool's margin (which learns meanwhile)
            return 1.0 if self.pool is None else self.pool.factor(predicted_s)
        pooled = self._pooled[own]
        if pooled is None:  # (the top octave's samples are among them: never empty)
            near: deque[float] = deque()
            for xs in self._ratios[lowest:top + 1]:
                near.extend(xs)
            pooled = self._pooled[own] = _quantile(near)
        return pooled

    def octaves(self) -> list[dict[str, float | int | None]]:
        """For /status: each octave with samples, its upper bound, factor and count."""
        return [{"upto_ms": round(2.0 ** (i + LOWEST + 1) * 1000, 3),
                 "factor": round(f, 4) if (f := self._factors[i]) is not None else None,
                 "samples": len(xs)}
                for i, xs in enumerate(self._ratios) if xs]
