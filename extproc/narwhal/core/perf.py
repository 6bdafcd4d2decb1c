"""Engine performance model v2: what an engine's next first token and next token cost,
learned from outside.

Why this shape. Continuous-batching engines (vLLM v1, SGLang) do not prefill one
request after another: every step spends a token budget on running decodes and on
chunked prefill in arrival order, and a step costs more with more tokens and more
context. Seen from the router, a request's time from dispatch to first token is then
close to linear in the prefill work ahead of it on that engine (its own uncached
prompt plus the uncached prompts dispatched before it that have not produced a first
token yet), with a slope that grows with the decodes sharing the steps. So the model
regresses measured TTFT on exactly those features, by recursive least squares with
forgetting (it follows an engine that slows down), instead of inferring a prefill rate
from gaps between first tokens (which collapse to zero when several first tokens leave
one step). The time per output token is regressed on the decode batch the same way.
Nothing here knows how the engine is built: it sees dispatches, first tokens, token
intervals and the engine's own prefix-cache counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TTFT_FORGET = 0.98  # ~50 samples of memory
# Drift is a bias that lasts, not a few late requests: the mean of about the last seven
# samples' signed errors. Replayed on the scheduling benchmark's per-request errors, the
# old setting (five samples, 0.25) fired 70 times in 2,700 samples of engines that had
# not changed (a rising decode population biases the model for a while, and a request
# arriving mid-step looks slow), each time taking the engine out for a profile; seven
# samples and 0.4 fired 17 times, and an engine at half speed is still found within
# ~11 samples (at a quarter, 4), while the model is learning it on its own meanwhile.
DRIFT_EWMA = 0.15
DRIFT_LIMIT = 0.4  # a mean signed error this large: the engine changed, forget the past
DRIFT_MIN_SAMPLES = 16  # samples after a reset before drift is judged again
TPOT_FORGET = 0.995
HIT_EWMA = 0.2
MIN_TTFT_S = 0.001


class Rls:
    """Recursive least squares with exponential forgetting, for 2-3 features.

    The covariance is kept from winding up (forgetting with samples that do not excite a
    feature makes its variance grow without bound): each variance is capped at its
    prior's, by scaling that row and column (which keeps the matrix positive definite
    and leaves the other features' gains alone)."""

    __slots__ = ("theta", "p", "forget", "cap")

    def __init__(self, theta: list[float], variance: list[float], forget: float) -> None:
        self.theta = list(theta)
        self.forget = forget
        self.cap = list(variance)
        self.p: list[list[float]] = []
        self.reset()

    def reset(self) -> None:
        """Back to the prior's uncertainty, keeping the estimate: learn fast again."""
        n = len(self.theta)
        self.p = [[self.cap[i] if i == j else 0.0 for j in range(n)] for i in range(n)]

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def update(self, x: list[float], y: float) -> float:
        """Learn one sample; return the prior prediction's error (y - prediction)."""
        n = len(x)
        p = self.p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = self.forget + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        err = y - self.predict(x)
        self.theta = [t + g * err for t, g in zip(self.theta, gain, strict=True)]
        self.p = [[(p[i][j] - gain[i] * px[j]) / self.forget for j in range(n)]
                  for i in range(n)]
        f = [min(1.0, (self.cap[i] / self.p[i][i]) ** 0.5) if self.p[i][i] > 0 else 1.0
             for i in range(n)]
        if any(v < 1.0 for v in f):
            self.p = [[self.p[i][j] * f[i] * f[j] for j in range(n)] for i in range(n)]
        return err


def _ttft_features(work: float, decodes: int) -> list[float]:
    # Scaled so that the prior's variances are of one order: seconds per 1000 tokens.
    # The fourth: even a short prefill waits out whole steps, and a step is longer with
    # more sequences in it (the intercept grows with the decode batch).
    k = work / 1000
    return [1.0, k, k * decodes / 100, decodes / 100]


def _tpot_features(decodes: int) -> list[float]:
    return [1.0, decodes / 10]


@dataclass(slots=True)
class PerfModel:
    """Seeds (``prefill_tps``, ``tpot_ms``, ``overhead_ms``) are where learning starts; a
    user who does not know the engine leaves them at their defaults and profiling plus
    the first few requests replace them."""

    prefill_tps: float
    tpot_ms: float
    overhead_ms: float
    ttft: Rls = field(init=False)
    tpot: Rls = field(init=False)
    hit_rate: float = 0.0  # the engine's recent prefix-cache hit fraction
    samples: int = 0
    # Mean signed relative TTFT error (measured - predicted) / measured, recent samples.
    drift: float = 0.0
    drift_resets: int = 0
    drift_limit: float = DRIFT_LIMIT  # telemetry.drift_threshold; 0: never reset
    _hits: tuple[float, float] | None = None  # last scraped (queries, hits)
    _since_reset: int = DRIFT_MIN_SAMPLES  # (the seeds may be judged at once)

    def __post_init__(self) -> None:
        # Wide priors (a step of 1 s, 10 s per 1000 tokens are within one deviation): the
        # seeds are guesses, and a slow engine must be learned from its first few samples.
        self.ttft = Rls([self.overhead_ms / 1000, 1000 / self.prefill_tps, 0.0, 0.0],
                        [1.0, 100.0, 1.0, 1.0], TTFT_FORGET)
        self.tpot = Rls([self.tpot_ms / 1000, 0.0], [1.0, 1.0], TPOT_FORGET)

    # -- predictions -------------------------------------------------------------------
    def uncached(self, tokens: int) -> float:
        """Prompt tokens the engine is expected to compute (its cache covers the rest)."""
        return tokens * (1.0 - self.hit_rate)

    def ttft_s(self, work: float, decodes: int) -> float:
        """Dispatch to first token with ``work`` uncached prefill tokens ahead and own,
        and ``decodes`` sequences sharing the steps."""
        return max(MIN_TTFT_S, self.ttft.predict(_ttft_features(work, decodes)))

    def tpot_s(self, decodes: int) -> float:
        return max(1e-4, self.tpot.predict(_tpot_features(decodes)))

    @property
    def learned_prefill_tps(self) -> float:
        slope = self.ttft.theta[1]
        return 1000 / slope if slope > 1e-9 else float("inf")

    # -- learning ----------------------------------------------------------------------
    def observe_ttft(self, work: float, decodes: int, seconds: float) -> float:
        """One measured dispatch-to-first-token time; returns its relative error."""
        predicted = self.ttft_s(work, decodes)
        if seconds <= 0:
            return 0.0
        # Least squares on the *relative* error (each sample scaled by 1/seconds): short
        # and long prefills count alike, and the fit is the one admission needs.
        self.ttft.update([v / seconds for v in _ttft_features(work, decodes)], 1.0)
        self.samples += 1
        err = (seconds - predicted) / seconds
        # Clipped below as it is above: a prediction many times the measurement is one
        # sample, and must not outweigh ten.
        self.drift += DRIFT_EWMA * (max(-1.0, err) - self.drift)
        self._since_reset += 1
        if (self.drift_limit and abs(self.drift) > self.drift_limit
                and self._since_reset >= DRIFT_MIN_SAMPLES):
            # Errors all one way: the engine is not what it was (slowed, sped up, or the
            # seeds were wrong). Reopen the model so the next samples re-learn it.
            self.ttft.reset()
            self.drift = 0.0
            self.drift_resets += 1
            self._since_reset = 0
        return err

    def observe_interval(self, decodes: int, seconds: float) -> None:
        if seconds > 0:
            self.tpot.update([v / seconds for v in _tpot_features(decodes)], 1.0)

    def observe_cache(self, queries: float, hits: float) -> None:
        """The engine's prefix-cache counters, cumulative; a restart resets them."""
        if self._hits is not None:
            dq, dh = queries - self._hits[0], hits - self._hits[1]
            if dq > 0 and dh >= 0:
                self.hit_rate += HIT_EWMA * (min(1.0, dh / dq) - self.hit_rate)
        self._hits = (queries, hits)
