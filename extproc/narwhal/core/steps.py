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

Nor when the engine takes a prompt in. An engine reads and tokenizes a request before
its scheduler sees it, and its scheduler takes new requests only between steps, while
the router sees a step start only when that step's predecessor's tokens reach it: a
prompt sent late in a step joins the step after next (the intake and that lag
together: ``intake``). And an engine runs at most so many sequences at once (vLLM's
``--max-num-seqs``): a prompt sent to a full engine waits in its queue until a sequence
finishes, however many steps that takes. Planned into a step that did not compute it,
a prompt teaches that step as having computed it and the one that did as having
computed nothing: on real vLLM, at its 8-sequence cap most of the time, the step
lengths learned read 0-0.13 ms a token where a prompt token cost ~0.9 ms (README,
"Against real vLLM"). So both are learned from outside: a prompt that was alone and
small was computed in the first step that took it in, so its intake lies between the
gaps from its dispatch to the starts of that step and of the one before it
(``_learn_intake``); the cap from the steps that did and did not take in the prompt
first in line, by the decode count they ran with (``_learn_cap``), limiting the plan
while the engine says it holds requests waiting (``engine_waiting``). A prompt joins the
plan only once it is in and has a seat.

What it does not know: the engine's token budget (``--max-num-batched-tokens``, which
users set and vLLM's default varies by version and GPU). So it follows one model per
budget in ``BUDGETS`` side by side and projects with the one whose projections have been
closest to the first tokens measured (a running mean of each one's relative error).
Nothing here reads the engine's settings or the simulator's model: only the times at
which Narwhal relayed tokens and the work it dispatched.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
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
INTAKE_WINDOW = 64  # prompts whose intake evidence is kept (``_learn_intake``)
INTAKE_MIN = 8  # evidence before an intake is used (until then: none)
RECOMPUTE_EVERY = 4  # new evidence between recomputations of the intake and the cap
SEAT_WINDOW = 128  # steps' evidence of the engine's sequence cap (``_learn_cap``)
CAP_EVIDENCE = 4  # prompts left out at or above a count before it is a cap
MAX_JOIN_STEPS = 16  # steps a projection walks until a prompt sent now is taken in


@dataclass(eq=False, slots=True)
class Prefill:
    """One dispatched prompt the engine has not answered yet."""

    at: float  # dispatched
    left: list[float]  # uncached prompt tokens not yet computed, per budget
    planned: list[float]  # of which the step under way computes, per budget
    projected: list[float] = field(default_factory=list)  # TTFT per budget at dispatch
    alive: bool = True
    work: float = 0.0  # uncached prompt tokens at dispatch
    next_start: float | None = None  # the first step that started after its dispatch
    clean: bool = False  # alone then, and small enough for that step: intake evidence
    # the first step that found it first in line, in the engine and small (seat evidence):
    # that step's start and the sequences decoding then
    head_start: float | None = None
    head_decodes: int = 0


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
                 "planned", "after", "last_token_at", "gap_s", "intake", "cap", "saturated",
                 "_seats", "_ended_decodes", "_head", "_held", "_ended_start", "_ended_before",
                 "_bounds", "_intake_new", "_cap_new", "_best_of")

    def __init__(self) -> None:
        n = len(BUDGETS)
        self.queue: deque[Prefill] = deque()
        self.lengths = [StepLength() for _ in range(n)]
        self.errors = [0.0] * n  # running mean relative error of each budget's projections
        self.judged = 0  # first tokens that judged them
        # ``_best``'s last answer and what it was computed from (the errors list, which
        # only a first token changes, and only as it counts ``judged``)
        self._best_of: tuple[list[float], int, int] | None = None
        self.step_start: float | None = None
        self.step_decodes = 0
        self.planned = [0.0] * n  # prefill tokens of the step under way, per budget
        self.after = [0.0] * n  # uncached work left after the step under way, per budget
        self.last_token_at: float | None = None
        self.gap_s = MIN_GAP_S
        self.intake = 0.0  # seconds from a dispatch to the first step that can take it
        # The sequences the engine runs at once, where it has shown a limit (``_learn_cap``;
        # 0: none), and whether it holds requests waiting (``engine_waiting``): then the
        # plan seats no more than that.
        self.cap = 0
        self.saturated = False
        self._seats: deque[tuple[int, bool]] = deque(maxlen=SEAT_WINDOW)  # (decodes, left out)
        self._ended_decodes = 0  # the sequences decoding in the step that ended last
        self._head: Prefill | None = None  # the step under way's, for ``_learn_cap``
        self._held = False  # the step under way's plan held a prompt out for a seat
        self._ended_start: float | None = None  # the start of the step that ended last
        self._ended_before: float | None = None  # and of the step before it
        # clean prompts' intakes were within these (seconds after dispatch)
        self._bounds: deque[tuple[float, float]] = deque(maxlen=INTAKE_WINDOW)
        self._intake_new = self._cap_new = 0  # evidence since each was last computed

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
        errs, judged, memo = self.errors, self.judged, self._best_of
        # Asked per engine per decision (placement projects every engine), answered anew
        # only after a first token judged the budgets (or their errors were replaced).
        if memo is not None and memo[0] is errs and memo[1] == judged:
            return memo[2]
        if not judged:
            best = DEFAULT
        else:
            bound = min(errs) * (1 + NEAR)
            best = next(i for i, err in enumerate(errs) if err <= bound)
        self._best_of = (errs, judged, best)
        return best

    def summary(self) -> dict[str, object]:
        """For /status: the budget projected with, its step-length fit, and each budget's
        running error (what chose it)."""
        i = self._best()
        length = self.lengths[i]
        return {"budget_tokens": BUDGETS[i], "steps": len(length),
                "step_fixed_ms": round(length.fixed * 1000, 3),
                "step_us_per_token": round(length.per_token * 1e6, 3),
                "judged": self.judged, "following": sum(p.alive for p in self.queue),
                "intake_ms": round(self.intake * 1000, 3), "intake_samples": len(self._bounds),
                "sequence_cap": self.cap, "saturated": self.saturated,
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
            # The same step's tokens. The count of sequences that decode in the next step
            # is the one after all of them (sequences that finished with this step end
            # with its tokens, the ones that started decoding too): the plan, made at its
            # first, is made again if a seat came free and a prompt was held out for one.
            start = self.step_start
            if decodes != self.step_decodes and start is not None:
                freed = decodes < self.step_decodes
                self.step_decodes = decodes
                if self._head is not None:  # the plan's, made at this step's start
                    self._head.head_decodes = decodes
                if freed and self._held:
                    self._plan(start, decodes)
            return False
        self._step_ended(now)
        self._plan(now, decodes)
        return True

    def _step_ended(self, now: float) -> None:
        start = self.step_start
        if start is None:
            return
        self._ended_before = self._ended_start
        self._ended_start = start
        self._ended_decodes = self.step_decodes
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
        older = False  # an older prompt is still waiting
        # sequences it may still run: a limit only while it holds requests waiting
        seats = self.cap - decodes if self.cap and self.saturated else 1 << 30
        head: Prefill | None = None  # first in line, in the engine and small
        held = False  # a prompt in the engine had no seat
        intake = self.intake
        taken_in = now - intake  # prompts sent since are not in the engine yet
        for p in queue:
            if not p.alive:
                continue
            small = decodes + 2 * p.work <= BUDGETS[0]
            if p.next_start is None and p.at < now:
                p.next_start = now
                p.clean = not older and small
            in_engine = not intake or p.at <= taken_in  # (no intake: every queued one is)
            if not older and in_engine and small and p.head_start in (None, now):
                p.head_start, p.head_decodes = now, decodes
                head = p
            older = True
            joined = in_engine and seats > 0
            if joined:
                seats -= 1
            elif in_engine:
                held = True
            for i in range(n):
                left = p.left[i]
                chunk = min(left, room[i]) if left > 0 and joined else 0.0
                p.planned[i] = chunk
                room[i] -= chunk
                planned[i] += chunk
                after[i] += max(0.0, left - chunk)
        self.planned = planned
        self.after = after
        self.step_start = now
        self.step_decodes = decodes
        self._head = head
        self._held = held

    def _learn_cap(self, p: Prefill) -> None:
        """``p`` answered at the end of the step that ended last. If a step found it first
        in line, in the engine and small, that step either took it in (answered at its
        end) with so many sequences decoding, or left it out: an engine that leaves such
        a prompt out runs all the sequences it can. The cap is the decode count from
        which the steps left them out: the threshold with the fewest on its wrong side,
        if at least ``CAP_EVIDENCE`` were left out at or above it (else none: an engine
        below its limit leaves a prompt out only by chance, its intake's spread).

        Why: an engine runs at most so many sequences at once (vLLM's ``--max-num-seqs``,
        256 by default on a GPU, 8 in this project's CPU tests), and a prompt sent while
        it runs that many waits in its queue until one finishes, not for the next step.
        Planned into the next step anyway, such prompts taught real vLLM's step lengths
        wrong (a recording of one through Narwhal at its capacity, replayed: 51 ms +
        0.08 ms a token, running error 0.65; given its cap, 0 ms + 0.70 ms, 0.23). Why
        not the most sequences it has shown running, tried: where it waits for token
        budget, not seats, that is no limit (the scheduling benchmark's l4, capped at its
        32 running early in a ramp, was planned short of prompts, its step model's
        error went to 0.87 and it was starved; 98.8% in budget); nor the most tokens one
        step ended with: through Envoy two steps' tokens sometimes come closer together
        than a step, and that read 16 for a cap of 8."""
        first = p.head_start
        answered_by = self._ended_start
        if first is None or answered_by is None or answered_by < first:
            return
        seen = self._seats
        seen.append((p.head_decodes, answered_by > first))
        if answered_by > first:  # and the step that answered it took it in
            seen.append((self._ended_decodes, False))
        self._cap_new += 1
        if self._cap_new < RECOMPUTE_EVERY:
            return
        self._cap_new = 0
        rows = sorted(seen)
        cap = 0
        if sum(out for _, out in rows) >= CAP_EVIDENCE:
            # a threshold at the least count: every one predicted left out
            wrong = best = sum(not out for _, out in rows)
            cap = rows[0][0]
            k = 0
            while k < len(rows):  # past each distinct count in turn
                d = rows[k][0]
                while k < len(rows) and rows[k][0] == d:
                    wrong += 1 if rows[k][1] else -1
                    k += 1
                if wrong <= best:  # ties: the larger threshold, the lesser limit
                    best, cap = wrong, rows[k][0] if k < len(rows) else 0
            if cap and sum(out for d, out in rows if d >= cap) < CAP_EVIDENCE:
                cap = 0
        self.cap = cap

    def engine_waiting(self, waiting: float) -> None:
        """The engine's own gauge, scraped: the requests it holds waiting. The cap
        (``_learn_cap``) limits the plan only while there are some, so that a cap learned
        from a few chance misses cannot hold prompts out of an engine that is not full."""
        self.saturated = waiting > 0

    # -- what Narwhal does ---------------------------------------------------------------
    def dispatched(self, work: float, now: float, decodes: int) -> Prefill:
        """A prompt of ``work`` uncached tokens sent to the engine: it joins the next step
        it fits in. Returns its handle (for ``first_token`` / ``dropped``)."""
        n = len(BUDGETS)
        p = Prefill(now, [work] * n, [0.0] * n, work=work)
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
        self._learn_intake(p)
        self._learn_cap(p)
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

    def _learn_intake(self, p: Prefill) -> None:
        """``p`` answered at the end of the step that ended last. If it was clean (nothing
        older waiting and small when the first step after its dispatch started), the step
        that computed it was the first to start once it was in: its intake was longer
        than the gap from its dispatch to the start of the step before that one (if that
        one started after the dispatch; else no shorter than nothing) and no longer than
        the gap to the answering step's start. Over the most recent prompts, the least
        value with the fewest prompts whose bounds exclude it (one held back by something
        else, a full engine, is outvoted) is where the intake may start, and the least
        upper bound of the prompts that allow it is where it must end: the intake is
        halfway. Where no prompt ever missed its step the least value is 0 and so is the
        intake: the plan is then what it was. Why not the least upper bound alone
        (tried, docs/measurements.md): with no intake that is the least of a few dozen
        uniform draws over a step, a thirtieth of a step too much, and a plan a step late
        for prompts sent that close to a step's start spoiled the fit as much as one a
        step early.
        Recomputed every ``RECOMPUTE_EVERY`` prompts (sorts and bisections: per first token
        it would cost a light-load request tens of microseconds)."""
        answered_by, before = self._ended_start, self._ended_before
        at = p.at
        if (not p.clean or p.next_start is None or answered_by is None
                or answered_by < p.next_start):
            return  # not clean, or sent to an idle engine (no step boundary before it)
        low = before - at if before is not None and before > at else 0.0
        bounds = self._bounds
        bounds.append((low, answered_by - at))
        self._intake_new += 1
        if len(bounds) < INTAKE_MIN or self._intake_new < RECOMPUTE_EVERY:
            return
        self._intake_new = 0
        lows = sorted(lo for lo, _ in bounds)
        highs = sorted(hi for _, hi in bounds)
        n = len(lows)
        best, at_least = n + 1, 0.0
        for c in sorted(set(lows) | set(highs)):  # excluded: a low above c, a high below
            wrong = n - bisect_right(lows, c) + bisect_left(highs, c)
            if wrong < best:
                best, at_least = wrong, c
        if at_least <= 0:
            self.intake = 0.0
            return
        at_most = min(hi for lo, hi in bounds if lo <= at_least <= hi)
        self.intake = (at_least + at_most) / 2

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
        return self._projection(i, work, decodes, now)

    def _projection(self, i: int, work: float, decodes: int, now: float
                    ) -> tuple[float, float]:
        """Budget ``i``'s wait for the step that takes a prompt sent now in, and its
        projection to that prompt's last chunk."""
        wait, ahead = self._join(i, now, decodes)
        return wait, wait + self._steps(i, ahead + work, decodes)

    def _join(self, i: int, now: float, decodes: int) -> tuple[float, float]:
        """Seconds from now to the start of the step that takes in a prompt sent now, and
        the uncached work still ahead of it then: the rest of the step under way, then the
        steps that start before the prompt is in (the intake), each computing what it
        has room for of the work ahead."""
        ahead = self.after[i]
        arrive = now + self.intake
        start = self.step_start
        if start is None:
            return self.intake, ahead
        length = self.lengths[i]
        t = max(now, start + length.seconds(self.step_decodes + self.planned[i]))
        room = max(1.0, BUDGETS[i] - decodes)
        for _ in range(MAX_JOIN_STEPS):
            if t >= arrive or (ahead <= 0 and decodes <= 0):
                break
            t += length.seconds(decodes + min(ahead, room))
            ahead = max(0.0, ahead - room)
        return max(t, arrive) - now, ahead

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
            return self.intake + self._steps(i, work, decodes)
        return self._projection(i, work, decodes, now)[1]
