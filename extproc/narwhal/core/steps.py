"""An engine's steps, followed from outside: which prefill each step is computing, and
so in which step a new request's first token comes.

Why. A continuous-batching engine (vLLM v1, SGLang) computes in steps: each step spends
a token budget on one token per running decode and on chunks of the waiting prompts,
oldest first, and every first token leaves at the end of the step that computed the
prompt's last chunk. Seen from the router, a request's time to first token is then a
sum of whole steps, not a line through the work ahead: on an engine whose loaded step is
a third of the budget, a prompt that just misses a step waits a whole step more (the
scheduling benchmark's a100: projections +7% on requests served in the next step,
-17% on those served a step later). The linear TTFT fit (``perf.py``) cannot draw that
staircase; this model does, and the fit takes it as one more feature, so that where it
is wrong the fit learns to weigh it less.

What it sees. Every token an engine streams leaves at a step's end, so the first token
after a gap (``token``) marks a new step; the tokens of one step arrive together. At each
step's start it plans that step as the engine would: the decodes, then the oldest
prompts' uncached work up to the budget; at its end it takes the planned work off those
prompts. A first token says that prompt and every older one are done (first tokens leave
in arrival order). Each step that computed prompts teaches a step's length against the
tokens it was planned to hold (least squares over recent such steps: a fixed cost and a
cost per token). Its projection is short only by what arrives later and shares the
prompt's last step, so ``PerfModel.ttft_s`` never projects less once it has been judged.

What it does not know: the engine's token budget (``--max-num-batched-tokens``, which
users set and vLLM's default varies by version and GPU). So it follows one model per
budget in ``BUDGETS`` side by side and projects with the one whose projections have been
closest to the first tokens measured (a running mean of each one's relative error).
Nothing here reads the engine's settings or the simulator's model: only the times at
which Narwhal relayed tokens and the work it dispatched.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

BUDGETS = (1024, 2048, 4096, 8192, 16384)  # step token budgets followed side by side
DEFAULT = 2  # the budget projected with before any first token has judged them (4096)
STEP_WINDOW = 64  # steps whose lengths the step-length fit remembers
MIN_STEPS = 4  # steps before the fit is used (until then: no projection, 0)
MIN_GAP_S = 0.002  # tokens closer than this belong to one step (see ``token``)
ERROR_EWMA = 0.05  # how fast a budget's running error follows new first tokens
NEAR = 0.1  # a budget within this share of the least error counts as as good (``_best``)
MAX_QUEUE = 4096  # prompts followed per engine (more: the oldest are forgotten)


@dataclass(eq=False, slots=True)
class Prefill:
    """One dispatched prompt the engine has not answered yet."""

    at: float  # dispatched
    left: list[float]  # uncached prompt tokens not yet computed, per budget
    planned: list[float]  # of which the step under way computes, per budget
    projected: list[float] = field(default_factory=list)  # TTFT per budget at dispatch
    alive: bool = True


class StepLength:
    """Least squares of a step's seconds on its tokens: ``fixed + per_token * tokens``."""

    __slots__ = ("_rows", "_sx", "_sy", "_sxx", "_sxy", "fixed", "per_token")

    def __init__(self) -> None:
        self._rows: deque[tuple[float, float]] = deque(maxlen=STEP_WINDOW)
        self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.fixed = 0.0
        self.per_token = 0.0

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, tokens: float, seconds: float) -> None:
        rows = self._rows
        if len(rows) == rows.maxlen:
            x, y = rows[0]
            self._sx -= x
            self._sy -= y
            self._sxx -= x * x
            self._sxy -= x * y
        rows.append((tokens, seconds))
        self._sx += tokens
        self._sy += seconds
        self._sxx += tokens * tokens
        self._sxy += tokens * seconds
        n = len(rows)
        mx, my = self._sx / n, self._sy / n
        var = self._sxx / n - mx * mx
        # More tokens never make a step shorter; steps all of one size say nothing of the
        # slope (the last one is kept).
        if var > 1e-9 * max(1.0, mx * mx):
            self.per_token = max(0.0, (self._sxy / n - mx * my) / var)
        self.fixed = max(0.0, my - self.per_token * mx)

    def seconds(self, tokens: float) -> float:
        return self.fixed + self.per_token * tokens


class StepModel:
    """One engine's steps; see the module docstring. Plain and synchronous: the engine's
    exchanges report tokens, the scheduler dispatches and first tokens."""

    __slots__ = ("queue", "lengths", "errors", "judged", "step_start", "step_decodes",
                 "planned", "after", "last_token_at", "gap_s")

    def __init__(self) -> None:
        n = len(BUDGETS)
        self.queue: deque[Prefill] = deque()
        self.lengths = [StepLength() for _ in range(n)]
        self.errors = [0.0] * n  # running mean relative error of each budget's projections
        self.judged = 0  # first tokens that judged them
        self.step_start: float | None = None
        self.step_decodes = 0
        self.planned = [0.0] * n  # prefill tokens of the step under way, per budget
        self.after = [0.0] * n  # uncached work left after the step under way, per budget
        self.last_token_at: float | None = None
        self.gap_s = MIN_GAP_S

    @property
    def budget(self) -> int:
        """The budget projections use: the one closest to the measurements so far."""
        return BUDGETS[self._best()]

    def _best(self) -> int:
        """The smallest budget whose running error is within ``NEAR`` of the least. Why
        not the least alone: budgets that no backlog so far has told apart err alike
        (every budget above the backlogs seen projects the same), and a near-tie flips
        with noise; a budget too large projects a long backlog short (requests late: a
        1.5x run lost 56 requests on an engine of 2,048 after its choice flipped to 4,096
        at errors 0.1155 against 0.1118), one too small projects it long (refusals)."""
        if not self.judged:
            return DEFAULT
        errs = self.errors
        bound = min(errs) * (1 + NEAR)
        return next(i for i, err in enumerate(errs) if err <= bound)

    def summary(self) -> dict[str, object]:
        """For /status: the budget projected with, its step-length fit, and each budget's
        running error (what chose it)."""
        i = self._best()
        length = self.lengths[i]
        return {"budget_tokens": BUDGETS[i], "steps": len(length),
                "step_fixed_ms": round(length.fixed * 1000, 3),
                "step_us_per_token": round(length.per_token * 1e6, 3),
                "judged": self.judged, "following": sum(p.alive for p in self.queue),
                "errors": {str(b): round(e, 4) for b, e in zip(BUDGETS, self.errors,
                                                                strict=True)}}

    # -- what the engine shows -----------------------------------------------------------
    def token(self, now: float, decodes: int) -> bool:
        """A token from the engine at ``now``; ``decodes`` sequences decode there. The
        first after a gap longer than ``gap_s`` ends the step under way and starts the
        next (True). The owner sets ``gap_s`` from what it knows of a decode step (the
        TPOT model: a length learned apart from this model, so that a wrong step length
        here cannot widen the gap, merge steps and grow wronger)."""
        last = self.last_token_at
        self.last_token_at = now
        if last is not None and now - last <= self.gap_s:
            return False  # the same step's tokens
        self._step_ended(now)
        self._plan(now, decodes)
        return True

    def _step_ended(self, now: float) -> None:
        start = self.step_start
        if start is None:
            return
        # Only steps that computed prompts teach step lengths: they are what a projection
        # adds up (decode-only steps, short and many, pulled a line through both below
        # the prefill steps it was used for: replayed, dispatch-to-first-token p90 25.3%
        # -> 24.4%), and a gap with nothing planned may be idle time, not a step.
        for i, planned in enumerate(self.planned):
            if planned > 0:
                self.lengths[i].add(self.step_decodes + planned, now - start)
        for p in self.queue:
            if p.alive:
                for i, done in enumerate(p.planned):
                    if done:
                        p.left[i] -= done
                        p.planned[i] = 0.0
        self.step_start = None

    def _plan(self, now: float, decodes: int) -> None:
        """The step starting now: decodes first, then the oldest prompts' chunks."""
        queue = self.queue
        while queue and not queue[0].alive:
            queue.popleft()
        n = len(BUDGETS)
        room = [max(0.0, b - decodes) for b in BUDGETS]
        planned = [0.0] * n
        after = [0.0] * n
        for p in queue:
            if not p.alive:
                continue
            for i in range(n):
                left = p.left[i]
                chunk = min(left, room[i]) if left > 0 else 0.0
                p.planned[i] = chunk
                room[i] -= chunk
                planned[i] += chunk
                after[i] += max(0.0, left - chunk)
        self.planned = planned
        self.after = after
        self.step_start = now
        self.step_decodes = decodes

    # -- what Narwhal does ---------------------------------------------------------------
    def dispatched(self, work: float, now: float, decodes: int) -> Prefill:
        """A prompt of ``work`` uncached tokens sent to the engine: it joins the next step
        it fits in. Returns its handle (for ``first_token`` / ``dropped``)."""
        n = len(BUDGETS)
        p = Prefill(now, [work] * n, [0.0] * n)
        p.projected = [self.project(work, decodes, now, i) for i in range(n)]
        for i in range(n):
            self.after[i] += work
        queue = self.queue
        if len(queue) >= MAX_QUEUE:
            self.dropped(queue[0])
            queue.popleft()
        queue.append(p)
        return p

    def first_token(self, p: Prefill, now: float) -> None:
        """``p``'s first token: it and every older prompt are computed (first tokens leave
        in arrival order). Judges each budget's projection for it."""
        if not p.alive:
            return
        measured = now - p.at
        if measured > 0 and p.projected:
            self.judged += 1
            errs = self.errors
            for i, projected in enumerate(p.projected):
                errs[i] += ERROR_EWMA * (abs(projected - measured) / measured - errs[i])
        # Off the queue as they are answered (a step's start also sweeps the dead from
        # its head, but an engine whose tokens never pause starts no step: left there,
        # answered prompts made every first token walk thousands of them).
        queue = self.queue
        while queue:
            q = queue.popleft()
            self.dropped(q)
            if q is p:
                break

    def dropped(self, p: Prefill) -> None:
        """``p`` leaves without the engine computing more of it (answered, cancelled,
        moved to another engine)."""
        if not p.alive:
            return
        p.alive = False
        for i in range(len(BUDGETS)):
            self.after[i] -= max(0.0, p.left[i] - p.planned[i])
            self.planned[i] -= p.planned[i]
            p.planned[i] = 0.0
            if self.after[i] < 0:
                self.after[i] = 0.0

    # -- projection ----------------------------------------------------------------------
    def estimate(self, work: float, decodes: int, now: float) -> tuple[float, float] | None:
        """With the budget that projects: what is left of the step under way (its planned
        tokens at the learned step length) and ``project``'s projection, computed
        together (placement asks for both per candidate); None before steps have been
        measured."""
        i = self._best()
        if len(self.lengths[i]) < MIN_STEPS:
            return None
        left = self._left(i, now)
        return left, left + self._steps(i, self.after[i] + work, decodes)

    def _left(self, i: int, now: float) -> float:
        if self.step_start is None:
            return 0.0
        length = self.lengths[i].seconds(self.step_decodes + self.planned[i])
        return max(0.0, self.step_start + length - now)

    def _steps(self, i: int, ahead: float, decodes: int) -> float:
        """Whole steps of budget ``i`` until ``ahead`` uncached tokens are computed."""
        length = self.lengths[i]
        room = max(1.0, BUDGETS[i] - decodes)
        full = int(ahead // room)
        rest = ahead - full * room
        total = full * length.seconds(decodes + room)
        if rest > 0:
            total += length.seconds(decodes + rest)
        return total

    def project(self, work: float, decodes: int, now: float, i: int | None = None,
                idle: bool = False) -> float:
        """Seconds from now to the first token of a prompt of ``work`` uncached tokens sent
        now: the rest of the step under way, then whole steps of the budget until its last
        chunk is computed (0 until steps have been measured). ``idle``: on the engine
        with nothing else to do (what the prompt costs alone)."""
        if i is None:
            i = self._best()
        if len(self.lengths[i]) < MIN_STEPS:
            return 0.0
        if idle:
            return self._steps(i, work, decodes)
        return self._left(i, now) + self._steps(i, self.after[i] + work, decodes)
