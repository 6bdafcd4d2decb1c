"""The learning loop's one sink: every measurement (a first token, a token interval, a
completion's identified output, a profile probe) comes here, and here alone models
change.

* decode correction: the engine's TTFT and TPOT models (``perf.py``) learn from each;
* drift scoring: when an engine's TTFT errors run one way its model is reopened and,
  with profiling on, the engine is measured again before it takes new work;
* admission calibration per engine: its measured/predicted TTFT ratios by size of projection;
* output-length learning (``outputs.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .engines import EngineState
from .outputs import OutputLengths
from .prediction_error import ErrorWindow
from .profiling import reprofile

if TYPE_CHECKING:
    from .pool import Pool
    from .profiling import Measurement
    from .scheduler import Ticket

ERROR_WINDOW = 2048  # prediction errors kept for /status, pool-wide


class Learning:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.errors = ErrorWindow(ERROR_WINDOW)
        self.outputs = OutputLengths()

    def first_token(self, t: Ticket, now: float) -> None:
        e = t.engine
        assert e is not None
        # a step of the engine that served, and the step model's check of its projection
        e.model.observe_first_token(now, t.dispatched_at, t.prefill)
        t.prefill = None
        if t.failover:  # its wait includes the failed attempt: no sample of this engine
            return
        resets = e.model.drift_resets
        e.model.observe_ttft(t.work_ahead, t.decodes_at_dispatch, now - t.dispatched_at,
                             t.step_wait, t.steps_s)
        e.verified_work = max(e.verified_work, t.work_ahead)
        # Drifted: measured again before it takes new work, unless it is the only engine
        # that can serve (its reopened model relearns from live traffic then: drift must
        # not become an outage).
        if (e.model.drift_resets != resets and self.pool.profiling
                and any(o is not e for o in self.pool.serviceable(now))):
            reprofile(e)
        if t.predicted_ttft_s is None:
            return
        measured = now - t.arrival
        if measured > 0:
            err = abs(t.predicted_ttft_s - measured) / measured
            self.errors.add(err)
            e.prediction_errors.add(err)  # which engine's projections run wide
        # Admission compares the budget with projection x the engine's calibration, so
        # that requests admitted close to the budget still meet it when the model is a
        # little optimistic about that engine (projections under 10 ms are not learned).
        # (The margins of requests placed on an idle engine are kept apart: EngineState.)
        margins = e.margins(t.placed_idle)
        if t.calibration_epoch == margins.epoch:  # else projected by a model gone
            margins.observe(t.predicted_ttft_s, measured)
        (self.pool.idle_calibration if t.placed_idle
         else self.pool.calibration).observe(t.predicted_ttft_s, measured)

    def completed(self, t: Ticket, output_tokens: int, last_token_at: float) -> None:
        """A completion with identified output: its mean time per output token (one
        sample a request: per-event gaps are chunking noise) and its output length."""
        e = t.engine
        if (e is not None and t.first_token_at is not None and output_tokens > 1
                and last_token_at > t.first_token_at):
            e.model.observe_interval(e.decode + 1,
                                     (last_token_at - t.first_token_at) / (output_tokens - 1))
        if t.output_keys:
            self.outputs.learn(t.output_keys, t.predicted_output, output_tokens)

    def profile(self, e: EngineState, probes: list[tuple[Measurement, float, int]]) -> None:
        """A profile's measurements, each with the work ahead and decodes at its start."""
        for m, work_ahead, decodes in probes:
            self.probe(e, m, work_ahead, decodes)
        if probes:  # before any live step, the promise's step (``PerfModel.step_s``)
            e.model.probe_step_s = max(m.ttft_s for m, _, _ in probes)

    def probe(self, e: EngineState, m: Measurement, work_ahead: float, decodes: int) -> None:
        e.model.observe_ttft(work_ahead + m.prompt_tokens, decodes, m.ttft_s)
        e.verified_work = max(e.verified_work, work_ahead + m.prompt_tokens)
        if e.prefix.capacity or e.kv is not None:  # what the prefix index is judged on
            e.prompt_sent(m.prompt_tokens, 0.0)
        if m.intervals:  # one sample a probe, as one a completion: per-event gaps are
            # read timing (two events in one read are a gap of ~0 s, which the relative
            # fit weighs thousands of times and projected a 5 ms engine under 1 ms)
            e.model.observe_interval(decodes + 1, sum(m.intervals) / len(m.intervals))

    def error_quantiles(self) -> dict[str, float | int | None]:
        return self.errors.summary()
