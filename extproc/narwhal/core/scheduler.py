"""Admission and placement: limits, predictive TTFT refusal, the FIFO queue, slots.

Pure and synchronous: the exchange asks ``admit`` once its body is sized; the
scheduler answers dispatch-now, queued, or a refusal; slot releases (first token,
end of stream) pump the queue and return the tickets that can now be dispatched.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..config import Config, EngineConfig
from . import errors
from .engines import EngineState
from .errors import HttpError
from .profiling import reprofile

ERROR_WINDOW = 2048  # prediction errors kept for /status
CALIBRATION_WINDOW = 256  # measured/predicted ratios behind the admission margin
CALIBRATION_QUANTILE = 0.95
CALIBRATION_MAX = 4.0


@dataclass(slots=True)
class Ticket:
    """One request's admission state, from sizing to its last token."""

    owner: Any  # the Exchange; opaque here
    tokens: int
    arrival: float
    budget_s: float
    deadline: float
    queued_at: float | None = None
    engine: EngineState | None = None
    dispatched_at: float = 0.0
    work: float = 0.0  # uncached prompt tokens on its engine
    work_ahead: float = 0.0  # the model's features at dispatch: work ahead + own,
    decodes_at_dispatch: int = 0  # and the decodes sharing the engine's steps
    predicted_ttft_s: float | None = None  # client-level projection at admission
    first_token_at: float | None = None
    done: bool = False
    # Endpoints the request may go to (a gateway's subset hint); None: any.
    candidates: frozenset[str] | None = None


class Decision:
    __slots__ = ()


@dataclass(slots=True)
class Dispatch(Decision):
    engine: EngineState


@dataclass(slots=True)
class Queued(Decision):
    pass


@dataclass(slots=True)
class Refuse(Decision):
    error: HttpError


class Scheduler:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.engines = [EngineState.from_config(e) for e in config.engines]
        self.queue: deque[Ticket] = deque()
        self.queued_tokens = 0
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self.ratios: deque[float] = deque(maxlen=CALIBRATION_WINDOW)
        # Admission compares the budget with projection x calibration: the p95 of recent
        # measured/predicted ratios (at least 1), so that requests admitted close to the
        # budget still meet it when the model is slightly optimistic.
        self.calibration = 1.0
        self._samples = 0
        self.stale_after_s = config.telemetry.stale_after_ms / 1000
        self.profiling = config.telemetry.profiling
        for e in self.engines:
            e.profiled = not self.profiling

    # -- membership (discovery) ------------------------------------------------------
    def reconcile(self, wanted: dict[str, EngineConfig]) -> tuple[list[str], list[str]]:
        """Make the pool match ``wanted`` (endpoint -> config): add the new, retire the
        gone (no new work; dropped once their in-flight requests end). Returns the
        names added and retired."""
        have = {e.endpoint: e for e in self.engines}
        added, retired = [], []
        for endpoint, cfg in wanted.items():
            e = have.get(endpoint)
            if e is None:
                e = EngineState.from_config(cfg)
                e.profiled = not self.profiling
                self.engines.append(e)
                added.append(cfg.name)
            elif e.retired:
                e.retired = False  # came back before it drained
        for endpoint, e in have.items():
            if endpoint not in wanted and not e.retired:
                e.retired = True
                retired.append(e.name)
        self.sweep()
        return added, retired

    def sweep(self) -> None:
        self.engines[:] = [e for e in self.engines if not (e.retired and e.in_flight == 0)]

    # -- eligibility ---------------------------------------------------------------
    def serviceable(self, now: float, candidates: frozenset[str] | None = None
                    ) -> list[EngineState]:
        return [e for e in self.engines if e.serviceable(now, self.stale_after_s)
                and (candidates is None or e.endpoint in candidates)]

    def all_stale(self, now: float) -> bool:
        live = [e for e in self.engines if not e.retired]
        return bool(live) and not any(e.fresh(now, self.stale_after_s) for e in live)

    def all_unprofiled(self, now: float) -> bool:
        """Engines are up, and not one is profiled yet: nothing can take work."""
        live = [e for e in self.engines if not e.retired and e.healthy
                and e.fresh(now, self.stale_after_s)]
        return bool(live) and not any(e.profiled for e in live)

    def all_in_maintenance(self) -> bool:
        live = [e for e in self.engines if not e.retired]
        return bool(live) and all(e.maintenance for e in live)

    # -- admission -----------------------------------------------------------------
    def _projected(self, e: EngineState, tokens: int, extra: float = 0.0) -> float:
        return e.model.ttft_s(e.prefill_work + e.model.uncached(tokens) + extra, e.decode)

    def admit(self, t: Ticket, now: float) -> Decision:
        engines = self.serviceable(now, t.candidates)
        if not engines:
            return Refuse(errors.backend_unavailable())
        # Queued work (if any) goes to the engines in proportion to their speed.
        rates = [min(1e9, e.model.learned_prefill_tps) for e in engines]
        total = sum(rates)
        projected = min(self._projected(e, t.tokens, self.queued_tokens * r / total)
                        for e, r in zip(engines, rates, strict=True))
        t.predicted_ttft_s = projected
        if self.config.admission.mode == "predictive":
            alone = min(e.model.ttft_s(e.model.uncached(t.tokens), 0) for e in engines)
            if alone > t.budget_s:
                return Refuse(errors.prompt_too_long(alone, t.budget_s))
            if projected * self.calibration > t.budget_s:
                return Refuse(errors.projected_over_budget(projected * self.calibration, t.budget_s))
        if not self.queue:
            engine = self._place(t, now, engines)
            if engine is not None:
                return Dispatch(engine)
        if len(self.queue) >= self.config.admission.queue_limit:
            return Refuse(errors.queue_full())
        t.queued_at = now
        self.queue.append(t)
        self.queued_tokens += t.tokens
        return Queued()

    def _place(self, t: Ticket, now: float, engines: list[EngineState]) -> EngineState | None:
        sched = self.config.scheduler
        best: EngineState | None = None
        best_key: tuple[float, int] | None = None
        candidates = t.candidates
        for e in engines:
            if not e.has_slot(sched.max_prefill_per_engine, sched.max_decode_per_engine):
                continue
            if candidates is not None and e.endpoint not in candidates:
                continue
            key = (self._projected(e, t.tokens), e.decode)
            if best_key is None or key < best_key:
                best, best_key = e, key
        if best is not None:
            best.prefill += 1
            best.dispatched += 1
            t.engine = best
            t.dispatched_at = now
            t.work = best.model.uncached(t.tokens)
            best.prefill_work += t.work
            t.work_ahead = best.prefill_work
            t.decodes_at_dispatch = best.decode
        return best

    def pump(self, now: float) -> list[Ticket]:
        """Dispatch queued tickets, in order, while an engine has a slot."""
        out: list[Ticket] = []
        if not self.queue:
            return out
        engines = self.serviceable(now)
        while self.queue:
            t = self.queue[0]
            if self._place(t, now, engines) is None:
                break
            self.queue.popleft()
            self.queued_tokens -= t.tokens
            t.queued_at = None
            out.append(t)
        return out

    def dequeue(self, t: Ticket) -> None:
        if t.queued_at is not None:
            self.queue.remove(t)
            self.queued_tokens -= t.tokens
            t.queued_at = None

    # -- slots -----------------------------------------------------------------------
    def first_token(self, t: Ticket, now: float) -> None:
        e = t.engine
        if e is None or t.first_token_at is not None:
            return
        t.first_token_at = now
        e.prefill -= 1
        e.decode += 1
        e.prefill_work = max(0.0, e.prefill_work - t.work)
        resets = e.model.drift_resets
        e.model.observe_ttft(t.work_ahead, t.decodes_at_dispatch, now - t.dispatched_at)
        if e.model.drift_resets != resets and self.profiling:
            reprofile(e)  # drifted: measured again before it takes new work
        if t.predicted_ttft_s is not None:
            measured = now - t.arrival
            if measured > 0:
                self.errors.append(abs(t.predicted_ttft_s - measured) / measured)
            if t.predicted_ttft_s > 0.01:
                self.ratios.append(measured / t.predicted_ttft_s)
                self._samples += 1
                if self._samples % 8 == 0:  # re-derive now and then, not per token
                    xs = sorted(self.ratios)
                    q = xs[min(len(xs) - 1, int(CALIBRATION_QUANTILE * len(xs)))]
                    self.calibration = min(CALIBRATION_MAX, max(1.0, q))

    def release(self, t: Ticket) -> None:
        if t.done:
            return
        t.done = True
        self.dequeue(t)
        e = t.engine
        if e is None:
            return
        if t.first_token_at is None:
            e.prefill -= 1
            e.prefill_work = max(0.0, e.prefill_work - t.work)
        else:
            e.decode -= 1
        if e.retired and e.in_flight == 0:
            self.sweep()

    def error_quantiles(self) -> dict[str, float | None]:
        if not self.errors:
            return {"p50": None, "p90": None, "samples": 0}
        xs = sorted(self.errors)

        def q(p: float) -> float:
            return round(xs[min(len(xs) - 1, math.floor(p * len(xs)))], 4)

        return {"p50": q(0.5), "p90": q(0.9), "samples": len(xs)}
