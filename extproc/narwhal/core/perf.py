"""Engine performance model v2: what an engine's next first token and next token cost,
learned from outside.

Why this shape. Continuous-batching engines (vLLM v1, SGLang) do not prefill one
request after another: every step spends a token budget on running decodes and on
chunked prefill in arrival order, and a step costs more with more tokens and more
context. Seen from the router, a request's time from dispatch to first token is then
close to linear in the prefill work ahead of it on that engine (its own uncached
prompt plus the uncached prompts dispatched before it that have not produced a first
token yet), with a slope that grows with the decodes sharing the steps. So the model
regresses measured TTFT on exactly those features, by least squares over a window of
recent samples (it follows an engine that slows down), instead of inferring a prefill rate
from gaps between first tokens (which collapse to zero when several first tokens leave
one step). The time per output token is regressed on the decode batch the same way.
Nothing here knows how the engine is built: it sees dispatches, first tokens, token
intervals and the engine's own prefix-cache counters.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from math import sqrt

from .steps import MIN_GAP_S, Prefill, StepModel

TTFT_WINDOW = 256  # samples the TTFT fit remembers (replayed: 64 -> 0.29, 256 -> 0.26 MAPE)
RIDGE = 0.01  # the pull toward the last estimate, as a share of each feature's weight
# Drift is a bias that lasts, not a few late requests: the mean of about the last seven
# samples' signed errors. Replayed on the scheduling benchmark's per-request errors, the
# old setting (five samples, 0.25) fired 70 times in 2,700 samples of engines that had
# not changed (a rising decode population biases the model for a while, and a request
# arriving mid-step looks slow), each time taking the engine out for a profile; seven
# samples and 0.4 fired 17 times, and an engine at half speed is still found within
# ~11 samples (at a quarter, 4), while the model is learning it on its own meanwhile.
DRIFT_EWMA = 0.15
DRIFT_LIMIT = 0.4  # a mean signed error this large (1.67x; see _drifted): the engine changed
DRIFT_MIN_SAMPLES = 16  # samples after a reset before drift is judged again
# What a reset keeps: the samples that showed the drift, the latest run of errors of its
# sign, up to 16 (in the replay a fit from nothing projected 30x its measurement right
# after a reset; keeping the last 16 held the worst case at 3x, but also kept samples
# from before a real change, and relearning a half-speed engine took longer).
DRIFT_KEEP = 16
# ... and only once the latest eight errors all ran that way: a changed engine's do
# (all of a half-speed engine's), while a model biased for a while by a shifting load
# is interrupted by noise (replayed: 22-39 -> 16-30 resets on engines that had not
# changed, over 1,900-4,600 samples).
DRIFT_RUN = 8
TPOT_WINDOW = 256
HIT_EWMA = 0.2
MIN_TTFT_S = 0.001
STEP_WINDOW = 8  # gaps between first-token steps whose median is the step's length
FLOOR_AFTER = 32  # first tokens judging the step model before it floors projections
SAME_STEP = 0.25  # first tokens closer than this share of a step left the same step


class WindowFit:
    """Least squares over the last ``window`` samples, pulled gently toward the estimate
    it had before each refit: for 2-4 features, refitted every sample.

    Why not recursive least squares with forgetting (what this replaced). The features
    are nearly collinear under steady load (the intercept and the decode count when the
    batch stays near 200 sequences): forgetting inflates the covariance along that
    unexcited direction, the estimate wanders along it, and a projection for another
    batch size extrapolates wildly. Replayed on ~4,500 requests of a simulated h100 at
    its capacity, the old learner's error grew without bound (MAPE 56, one projection
    40,000x its measurement) unless the drift detector reset it, which it did 21 times
    on an engine that had not changed; this fit, with no reset at all, had MAPE 0.26
    (old, with resets: 0.30) and a worst case of 2.3x (with the drift detector on, as by
    default: 0.26, 3.8x and 15 resets; the old one's worst was 14x). A window forgets a direction by
    losing its samples, never by amplifying it, and the pull (``RIDGE`` of each
    feature's own weight) holds a direction no sample excites where it was."""

    __slots__ = ("theta", "_rows", "_a", "_b", "_n", "_prior", "_order")

    def __init__(self, theta: list[float], variance: list[float], window: int) -> None:
        self.theta = [float(t) for t in theta]
        # a fixed pull too, the prior's (1 / its variance), which only matters while there
        # are few samples: an exact fit of five probes extrapolated to the first loaded
        # requests projected them at nothing
        self._prior = [1.0 / v for v in variance]
        self._rows: deque[list[float]] = deque(maxlen=window)
        self._a: list[list[float]] = []  # the window's X'X and X'1, kept as sums
        self._b: list[float] = []
        self._n = 0  # samples since the sums were last rebuilt
        # The coefficients in the order they are solved for: those held at zero by the
        # last update last (see ``update``).
        self._order = list(range(len(theta)))
        self._refill([])

    def reset(self, keep: int = 0) -> None:
        """Forget all but the last ``keep`` samples, keep the estimate: the next samples
        re-learn it fast."""
        self._refill(list(self._rows)[-keep:] if keep else [])

    def _refill(self, rows: list[list[float]]) -> None:
        """The window holds exactly ``rows``, its sums recomputed from them."""
        n = len(self.theta)
        self._rows.clear()
        self._a = [[0.0] * n for _ in range(n)]
        self._b = [0.0] * n
        for r in rows:
            self._rows.append(r)
            self._add(r, 1.0)

    def predict(self, x: list[float]) -> float:
        theta = self.theta
        if len(x) != len(theta):
            raise ValueError(f"{len(x)} features for {len(theta)} coefficients")
        total = 0.0
        for i in range(len(theta)):
            total += theta[i] * x[i]
        return total

    def update(self, x: list[float], y: float) -> float:
        """Learn one sample (``x . theta ~ y``); return the prior prediction's error."""
        err = y - self.predict(x)
        rows = self._rows
        row = [*x, y]
        if len(rows) == rows.maxlen:
            self._replace(rows[0], row)
        else:
            self._add(row, 1.0)
        rows.append(row)
        self._n += 1
        if self._n >= 4 * (rows.maxlen or 1):  # rebuild the sums: no rounding creep
            self._n = 0
            self._refill(list(rows))
        # Normal equations with the pull toward the current estimate. No coefficient may
        # be negative (more work, more sequences, never less time): one that comes out
        # negative is held at zero and the rest refitted, so that a few noisy samples
        # (a profile on a busy host) cannot make a longer prompt project shorter. The
        # coefficients held at zero are usually the same from one sample to the next, so
        # they are solved for last: the refit without them is then the leading part of
        # the factors already computed, and costs a back substitution instead of a solve.
        a, b, prior, theta0 = self._a, self._b, self._prior, self.theta
        n = len(x)
        pull = [RIDGE * a[i][i] + prior[i] for i in range(n)]
        rhs = [b[i] + pull[i] * theta0[i] for i in range(n)]
        # A feature that was 0 in every sample of the window (an idle engine's decodes and
        # steps) has an equation of its own, ``pull t = pull theta0``: its coefficient
        # stays where it was, and the solve is over the rest.
        theta = [0.0] * n
        order, still = [], []
        for i in self._order:
            if a[i][i]:
                order.append(i)
            else:
                still.append(i)
                theta[i] = theta0[i]
        factors = _factor(a, rhs, pull, order)
        k = len(order)
        while factors is not None:
            solved = _back(*factors, k)
            if not solved or min(solved) >= 0.0:
                for i, v in zip(order, solved, strict=False):
                    theta[i] = v
                self.theta = theta
                self._order = order + still
                return err
            kept = [i for i, v in zip(order, solved, strict=False) if v > 0.0]
            if not kept:
                break
            if kept != order[:len(kept)]:
                order = kept + [i for i in order if i not in kept]
                factors = _factor(a, rhs, pull, order[:len(kept)])
            k = len(kept)
        return err

    def _add(self, row: list[float], sign: float) -> None:
        """Add (``sign`` 1) or remove (-1) one sample's terms; ``_a`` is symmetric and
        only its upper triangle (``j >= i``) is kept."""
        n = len(row) - 1
        y = row[n]
        a, b = self._a, self._b
        for i in range(n):
            ri = sign * row[i]
            if ri:  # a feature at 0 (no decodes running) adds nothing to its row
                b[i] += ri * y
                ai = a[i]
                for j in range(i, n):
                    ai[j] += ri * row[j]

    def _replace(self, old: list[float], new: list[float]) -> None:
        """The window's oldest sample out and a new one in, in one pass over the sums."""
        n = len(new) - 1
        yo, yn = old[n], new[n]
        a, b = self._a, self._b
        for i in range(n):
            oi, ni = old[i], new[i]
            if oi or ni:
                b[i] += ni * yn - oi * yo
                ai = a[i]
                for j in range(i, n):
                    ai[j] += ni * new[j] - oi * old[j]


def _factor(a: list[list[float]], rhs: list[float], pull: list[float], idx: list[int]
            ) -> tuple[list[list[float]], list[float]] | None:
    """Cholesky factors of ``(A + diag(pull))`` restricted to the indices ``idx``, in that
    order (``A`` given by its upper triangle), and the forward solution ``z`` of
    ``L z = rhs``: ``L`` row by row, ``A = L L'``. The matrix is a sum of squares plus a
    positive pull, so symmetric positive definite: no pivoting. Any leading part of the
    result is the factors of the leading part of ``idx`` (what ``update`` reuses). None:
    not positive definite (rounding on a degenerate window)."""
    low: list[list[float]] = []
    z: list[float] = []
    for i, fi in enumerate(idx):
        li = [0.0] * (i + 1)  # zeros past what is computed: they add nothing below
        for j in range(i):
            lj = low[j]
            fj = idx[j]
            s = a[fj][fi] if fj < fi else a[fi][fj]
            for u, v in zip(li, lj, strict=False):
                s -= u * v
            li[j] = s / lj[j]
        s = a[fi][fi] + pull[fi]
        zi = rhs[fi]
        for u, v in zip(li, z, strict=False):
            s -= u * u
            zi -= u * v
        if s < 1e-300:
            return None
        d = sqrt(s)
        li[i] = d
        z.append(zi / d)
        low.append(li)
    return low, z


def _back(low: list[list[float]], z: list[float], k: int) -> list[float]:
    """Solve ``L' t = z`` on the leading ``k`` rows of the factors."""
    out = [0.0] * k
    for i in range(k - 1, -1, -1):
        s = z[i]
        for j in range(i + 1, k):
            s -= low[j][i] * out[j]
        out[i] = s / low[i][i]
    return out


# ``_ttft_features``' names, in order: seconds, seconds per 1,000 prompt tokens of work,
# the same per 100 decoding sequences, seconds per 100 decoding sequences, and the
# weights of the step under way's remainder and of the step model's projection.
TTFT_FEATURES = ("fixed_s", "per_1k_tokens_s", "per_1k_tokens_per_100_decodes_s",
                 "per_100_decodes_s", "step_wait", "steps")


def _ttft_features(work: float, decodes: int, step_wait: float,
                   steps: float) -> list[float]:
    # Scaled so that the prior's variances are of one order: seconds per 1000 tokens.
    # The fourth: even a short prefill waits out whole steps, and a step is longer with
    # more sequences in it (the intercept grows with the decode batch). The fifth: what
    # is left of the step under way when the request arrives (as the step model planned
    # it, ``StepModel.estimate``, once it has measured steps; before, ``step_wait_s``). The
    # sixth: the step model's projection, whole steps until the prompt's last chunk
    # (``steps.py``; 0 until it has measured steps).
    k = work / 1000
    return [1.0, k, k * decodes / 100, decodes / 100, step_wait, steps]


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
    ttft: WindowFit = field(init=False)
    tpot: WindowFit = field(init=False)
    hit_rate: float = 0.0  # the engine's recent prefix-cache hit fraction
    samples: int = 0
    # Mean signed relative TTFT error (measured - predicted) / measured, recent samples.
    drift: float = 0.0
    drift_resets: int = 0
    drift_limit: float = DRIFT_LIMIT  # telemetry.drift_threshold; 0: never reset
    _hits: tuple[float, float] | None = None  # last scraped (queries, hits)
    _since_reset: int = DRIFT_MIN_SAMPLES  # (the seeds may be judged at once)
    _run: int = 0  # the latest samples' errors all of one sign: how many, signed
    _first_at: float | None = None  # the latest first token
    _steps: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    probe_step_s: float = 0.0  # the latest profile's longest probe TTFT (see step_s)
    last_step_at: float | None = None  # the latest token seen from the engine: a step's end
    step_model: StepModel = field(default_factory=StepModel)  # which prefill each step computes
    # ``tpot_s``'s last answer: (decodes, the TPOT fit's coefficients it used, seconds)
    _tpot_of: tuple[int, list[float], float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Wide priors (a step of 1 s, 10 s per 1000 tokens are within one deviation): the
        # seeds are guesses, and a slow engine must be learned from its first few samples.
        # The step left to wait counts one for one until measured otherwise; the step
        # model's projection counts for nothing until the samples show what it is worth
        # (replayed on a 1.5x benchmark run's first tokens: the fit learns to weigh it
        # within the warm-up).
        self.ttft = WindowFit([self.overhead_ms / 1000, 1000 / self.prefill_tps, 0.0, 0.0, 1.0,
                               0.0],
                              [1.0, 100.0, 1.0, 1.0, 1.0, 1.0], TTFT_WINDOW)
        self.tpot = WindowFit([self.tpot_ms / 1000, 0.0], [1.0, 1.0], TPOT_WINDOW)

    # -- predictions -------------------------------------------------------------------
    def uncached(self, tokens: int) -> float:
        """Prompt tokens the engine is expected to compute (its cache covers the rest)."""
        return tokens * (1.0 - self.hit_rate)

    def ttft_s(self, work: float, decodes: int, step_wait: float = 0.0,
               steps: float = 0.0) -> float:
        """Dispatch to first token with ``work`` uncached prefill tokens ahead and own,
        ``decodes`` sequences sharing the steps, ``step_wait`` seconds left of the
        step under way, and ``steps`` the step model's projection: never less than that
        projection once the step model has been judged by ``FLOOR_AFTER`` first tokens.
        Why the floor: the staircase leaves out only what arrives later, so it is short
        where it errs, while the fit, a line learned where backlogs usually are,
        extrapolates short past them (an a100 handed 8.6 k tokens of backlog, 1.3x the
        most it had verified, projected its requests at 7-9 s and served them in 12-16 s:
        20 late in 8 s). Replayed on a 1.5x run, the floor binds almost never (p90 24.4%
        either way, dispatch to first token). Why not at once: on a cold pool the step
        model's first steps and budget are guesses; floored from the first request, the
        first 20 s of a cold 1.0x cell ran at p90 92% against 67% without the floor
        (replayed on its log; the whole cell 45% floored at once, 44% never, 40.5% after
        32 first tokens)."""
        # ``self.ttft.predict(_ttft_features(...))`` written out: asked per engine per
        # decision (placement projects every engine, 0.4 us a call for the generic form,
        # 0.17 written out), with the same products summed in the same order, so the
        # same float (``tests/test_perf.py``).
        th = self.ttft.theta
        k = work / 1000
        fitted = (th[0] + th[1] * k + th[2] * (k * decodes / 100) + th[3] * (decodes / 100)
                  + th[4] * step_wait + th[5] * steps)
        if self.step_model.judged >= FLOOR_AFTER:
            fitted = max(fitted, steps)
        return max(MIN_TTFT_S, fitted)

    def step_wait_s(self, now: float, prefilling: bool, decodes: int) -> float:
        """What is left of the engine's step under way: a request arriving now joins the
        next one. Why: an engine plans a step, runs it, and only then takes new work, so
        on an engine whose loaded step is a large share of the budget (an l4's prefill
        step: ~0.6 of 1 s) when in the step a request arrives is the largest part of its
        error (replayed on three benchmark runs' samples: the l4's p90 error 41-48%
        without it, 31-34% with it). The step's end is the latest token seen from the
        engine (every running sequence's token leaves at a step's end; with
        ``serving.workers`` the scheduler sees first tokens only, a coarser clock); its
        length is a loaded prefill step's while prefills are under way (0 before one is
        measured: a profile's probe is no loaded step), else a decode step's (the TPOT
        model). An idle engine starts at once."""
        last = self.last_step_at
        if last is None or (not prefilling and decodes <= 0) or (prefilling and not self._steps):
            return 0.0
        step = self._step_median() if prefilling else self.tpot_s(decodes)
        return max(0.0, step - (now - last))

    def tpot_s(self, decodes: int) -> float:
        """Asked per engine per decision with the engine's decode count, which moves far
        less often than decisions are made: the last answer stands while the count and
        the fit's coefficients (a new list at every refit) are the ones it was made with."""
        theta, memo = self.tpot.theta, self._tpot_of
        if memo is not None and memo[0] == decodes and memo[1] is theta:
            return memo[2]
        seconds = max(1e-4, self.tpot.predict(_tpot_features(decodes)))
        self._tpot_of = (decodes, theta, seconds)
        return seconds

    def ttft_fit(self) -> dict[str, float]:
        """The TTFT fit's coefficients by feature (``_ttft_features``), for /status: what
        an engine's projections are made of, where they run wide."""
        return dict(zip(TTFT_FEATURES, (round(t, 6) for t in self.ttft.theta), strict=True))

    @property
    def learned_prefill_tps(self) -> float:
        slope = self.ttft.theta[1]
        return 1000 / slope if slope > 1e-9 else float("inf")

    # -- learning ----------------------------------------------------------------------
    def observe_ttft(self, work: float, decodes: int, seconds: float,
                     step_wait: float = 0.0, steps: float = 0.0) -> float:
        """One measured dispatch-to-first-token time; returns its relative error."""
        predicted = self.ttft_s(work, decodes, step_wait, steps)
        if seconds <= 0:
            return 0.0
        # Least squares on the *relative* error (each sample scaled by 1/seconds): short
        # and long prefills count alike, and the fit is the one admission needs.
        features = _ttft_features(work, decodes, step_wait, steps)
        self.ttft.update([v / seconds for v in features], 1.0)
        self.samples += 1
        err = (seconds - predicted) / seconds
        # Clipped below as it is above: a prediction many times the measurement is one
        # sample, and must not outweigh ten.
        self.drift += DRIFT_EWMA * (max(-1.0, err) - self.drift)
        sign = 1 if err > 0 else -1
        self._run = self._run + sign if self._run * sign > 0 else sign
        self._since_reset += 1
        same_way = self._run if self.drift > 0 else -self._run  # the run of drift's sign
        if (self.drift_limit and self._drifted()
                and self._since_reset >= DRIFT_MIN_SAMPLES and same_way >= DRIFT_RUN):
            # Errors all one way: the engine is not what it was (slowed, sped up, or the
            # seeds were wrong). Reopen the model so the next samples re-learn it.
            self.ttft.reset(min(DRIFT_KEEP, same_way))
            self.drift = 0.0
            self.drift_resets += 1
            self._since_reset = 0
        return err

    def _drifted(self) -> bool:
        """The mean error is past the limit, judged as a ratio both ways. Why: with the
        error relative to the measurement, an engine 1.67x slower than modeled runs at
        +0.4, but one 1.67x faster at -0.67 (and -0.4 is only 1.4x faster). Judged at
        -0.4, an engine merely projected a little long (safe for every promise) was found
        drifted and taken out to be profiled: 3 of the 5 resets in two steady-state runs
        of the scheduling benchmark, engines that had not changed, each out for 6-14 s
        and then refilled at once."""
        limit = self.drift_limit
        if self.drift > 0:
            return self.drift > limit
        return self.drift < -limit / (1.0 - limit)

    @property
    def step_s(self) -> float:
        """How long one of the engine's prefill steps lasts: the median of the recent gaps
        between first tokens that a waiting request saw; before any, the longest TTFT of
        its latest profile's probes (0 before a profile).

        Why the probes: an engine that has just joined (or come back) takes its first
        loaded requests before any of them has waited across a step, and its fit, learned
        from probes that never shared a step, does not see the step that a request
        arriving under load waits out (a cold l4 under the tenants benchmark: requests
        projected at 0.6-0.85 s measured at 1-1.5 s). Its longest probe's prefill (1,536
        tokens, on an idle engine) is one step holding a long prefill: a lower bound of
        a loaded step where the token budget is larger, the whole of it where not."""
        return self._step_median() if self._steps else self.probe_step_s

    def _step_median(self) -> float:
        steps = sorted(self._steps)
        return steps[len(steps) // 2]

    @property
    def live_steps(self) -> int:
        """Live step gaps ``step_s`` has (0: it is the profile's longest probe)."""
        return len(self._steps)

    def token(self, now: float, decodes: int) -> None:
        """A token Narwhal relayed from the engine at ``now`` (``decodes`` sequences decode
        there): it left at the end of one of the engine's steps. (With
        ``serving.workers`` the scheduler hears from each worker the tokens that follow a
        pause, so every step's first token, possibly a little out of order between
        workers: a token older than the latest is of a step already seen.)"""
        last = self.last_step_at
        if last is not None and now < last:
            return
        self.last_step_at = now
        if self.step_model.token(now, decodes):  # a new step: tokens of one step arrive
            # within a fraction of a decode step of each other
            self.step_model.gap_s = max(MIN_GAP_S, SAME_STEP * self.tpot_s(decodes))

    def observe_first_token(self, now: float, dispatched_at: float,
                            prefill: Prefill | None = None) -> None:
        """A first token at ``now`` of a request dispatched at ``dispatched_at``
        (``prefill``: its handle in the step model).

        Why: first tokens leave the engine at the ends of its steps. The gap from the
        previous first token to this one, for a request that was already waiting there
        when the previous one came, spans at least one whole step of the engine under
        load (first tokens of one step arrive together and count as one)."""
        self.last_step_at = now
        if prefill is not None:
            self.step_model.first_token(prefill, now)
        last = self._first_at
        if last is not None and now - last < max(0.002, SAME_STEP * self.step_s):
            self._first_at = now  # the same step
            return
        if last is not None and dispatched_at < last:
            self._steps.append(now - last)
        self._first_at = now

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
