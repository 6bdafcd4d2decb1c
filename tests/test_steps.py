"""The step model follows a continuous-batching engine's steps from outside.

The engine here is a loop in the test, not Narwhal's and not the simulator's: every step
spends a token budget on the running decodes and then on the oldest waiting prompts'
chunks (only prompts that were there when the step began), costs a fixed time plus a
time per token, and every prompt whose last chunk it computed answers at its end. The
model sees what a router sees: the tokens at each step's end, its own dispatches and
the first tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from narwhal.core.perf import FLOOR_AFTER, PerfModel
from narwhal.core.steps import BUDGETS, MAX_QUEUE, MIN_STEPS, NEAR, StepModel


@dataclass
class Waiting:
    left: float
    at: float
    handle: object
    projected: float
    ahead: float = 0.0  # the work ahead and its own, as the router counts it
    fits: tuple[float, float] = (0.0, 0.0)  # the fits' projections with and without


def drive(model: StepModel, budget: int, steps: int, seed: int = 1,
          decodes: int = 40, perfs: tuple[PerfModel, PerfModel] | None = None,
          fixed: float = 0.05, per_token: float = 0.0005, intake: float = 0.0
          ) -> list[tuple[float, float, tuple[float, float]]]:
    """Run the engine for ``steps`` steps at about two thirds of its capacity (prompts
    of 5-150% of a step's budget); returns (projected, measured, the fits' projections)
    per first token. ``perfs``: TTFT fits, the first given the step model's projection
    as its feature and the second not, both learning from every first token. ``intake``:
    a prompt is taken in (and can join a step) that long after it is sent."""
    rng = random.Random(seed)
    now = 0.0
    waiting: list[Waiting] = []
    out = []
    model.token(now, decodes)
    for _ in range(steps):
        # the step plans what is waiting now: decodes first, then the oldest prompts
        room = budget - decodes
        plan: list[tuple[Waiting, float]] = []
        for w in waiting:
            chunk = min(w.left, room)
            if chunk <= 0 or w.at + intake > now:
                break
            plan.append((w, chunk))
            room -= chunk
        seconds = fixed + per_token * (budget - room)
        # requests arrive during the step (they join a later one)
        arrivals = sorted(now + rng.random() * seconds
                          for _ in range(rng.choice((0, 0, 0, 1, 1, 2))))
        for at in arrivals:
            work = float(rng.randint(budget // 20, budget * 3 // 2))
            projected = model.project(work, decodes, at)
            ahead = sum(w.left for w in waiting) + work
            fits = (0.0, 0.0)
            if perfs is not None:
                fits = (perfs[0].ttft_s(ahead, decodes, 0.0, projected),
                        perfs[1].ttft_s(ahead, decodes))
            waiting.append(Waiting(work, at, model.dispatched(work, at, decodes), projected,
                                   ahead, fits))
        now += seconds
        model.token(now, decodes)  # the decodes' tokens mark the step's end
        for w, chunk in plan:
            w.left -= chunk
            if w.left <= 0:
                waiting.remove(w)
                model.first_token(w.handle, now)  # type: ignore[arg-type]
                measured = now - w.at
                if perfs is not None:
                    perfs[0].observe_ttft(w.ahead, decodes, measured, 0.0, w.projected)
                    perfs[1].observe_ttft(w.ahead, decodes, measured)
                out.append((w.projected, measured, w.fits))
    return out


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[int(0.9 * len(xs))]


@pytest.mark.parametrize("budget", [2048, 8192])
def test_the_model_finds_the_budget_and_projects_whole_steps(budget):
    model = StepModel()
    seen = drive(model, budget, 600, per_token=0.0005 * 2048 / budget)
    assert model.budget == budget
    length = model.lengths[BUDGETS.index(budget)]
    assert length.fixed == pytest.approx(0.05, rel=0.05)
    assert length.per_token == pytest.approx(0.0005 * 2048 / budget, rel=0.05)
    late = seen[len(seen) // 3:]
    # Never long; short only by what arrives later and shares the prompt's last step
    # (prompts sent after it, which the engine packs beside its last chunk).
    assert all(p <= m * (1 + 1e-9) for p, m, _ in late)
    errors = sorted((m - p) / m for p, m, _ in late)
    assert errors[len(errors) // 2] < 0.05
    assert model.summary()["budget_tokens"] == budget
    assert model.intake == 0.0  # every prompt joined the first step after its dispatch


@pytest.mark.parametrize("intake", [0.03, 0.1, 0.3])
def test_the_model_learns_the_engines_intake_and_plans_prompts_after_it(intake):
    """An engine that takes a prompt in ``intake`` after it is sent (an API server's
    reading and tokenizing, longer than some of its steps): planned into the first step
    after its dispatch, prompts taught a 10 ms + 0.5 ms a token engine as ~0.49 s + 0
    (and the wrong budget); learned from the steps that did or did not take clean
    prompts in, the intake is found and the fit is the engine's again."""
    model = StepModel()
    seen = drive(model, 2048, 1500, fixed=0.01, intake=intake)
    assert intake * 0.95 <= model.intake <= intake * 1.05
    assert model.budget == 2048
    length = model.lengths[BUDGETS.index(2048)]
    assert length.per_token == pytest.approx(0.0005, rel=0.3)
    late = seen[len(seen) // 3:]
    errors = sorted(abs(p - m) / m for p, m, _ in late)
    assert errors[len(errors) // 2] < 0.3
    assert model.summary()["intake_ms"] == pytest.approx(model.intake * 1000, abs=1e-3)


def capped(model: StepModel, cap: int, steps: int, scrape: bool, seed: int = 3,
           fixed: float = 0.02, per_token: float = 0.001) -> None:
    """An engine that runs at most ``cap`` sequences (vLLM's --max-num-seqs), kept full:
    a prompt (20-400 tokens, computed in one step) waits in its queue for a sequence to
    finish (outputs of 10-40 tokens). At each step's end every running sequence's token
    reaches the model, those that finished leave, then the first tokens; ``scrape``: its
    waiting gauge is read every step."""
    rng = random.Random(seed)
    now = 0.0
    running: list[int] = []  # output tokens left of each decoding sequence
    waiting: list[tuple[object, float]] = []  # (handle, work)
    for _ in range(steps):
        seated = []
        while waiting and len(running) + len(seated) < cap:
            seated.append(waiting.pop(0))
        seconds = fixed + per_token * (len(running) + sum(w for _, w in seated))
        for _ in range(rng.choice((0, 1, 1, 2))):  # arrivals during the step
            work = float(rng.randint(20, 400))
            waiting.append((model.dispatched(work, now + rng.random() * seconds,
                                             len(running)), work))
        now += seconds
        decodes = len(running)
        for k in range(len(running)):
            model.token(now, decodes)
            running[k] -= 1
            if running[k] == 0:
                decodes -= 1  # its stream ends with this token
        running = [left for left in running if left > 0]
        for handle, _ in seated:
            model.token(now, decodes + 1)
            model.first_token(handle, now)  # type: ignore[arg-type]
            decodes += 1
            running.append(rng.randint(10, 40))
        if scrape:
            model.engine_waiting(len(waiting))


def test_an_engine_at_its_sequence_cap_is_planned_a_prompt_only_as_a_seat_frees():
    """A full engine leaves a prompt first in line out of its steps until a sequence
    finishes; the model learns the cap from the steps that did and did not take such a
    prompt in, and while the engine says it holds requests waiting, plans no more. The
    step lengths learned are then the engine's: planned into the next step regardless,
    prompts that waited for a seat taught decode steps as having computed them."""
    told, blind = StepModel(), StepModel()
    capped(told, 12, 3000, scrape=True)
    capped(blind, 12, 3000, scrape=False)
    assert told.cap == blind.cap == 12  # learned either way; used only when told full
    assert told.saturated and not blind.saturated
    lengths = {id(m): m.lengths[BUDGETS.index(m.budget)] for m in (told, blind)}
    assert lengths[id(told)].per_token == pytest.approx(0.001, rel=0.2)
    assert abs(lengths[id(blind)].per_token - 0.001) > 0.3 * 0.001
    assert told.summary()["sequence_cap"] == 12



def test_the_fit_takes_the_staircase_as_a_feature():
    """The TTFT fit, given the step model's projection as its sixth feature, learns to
    weigh it (the prior gives it nothing) and ends within a few percent."""
    aware, blind = (PerfModel(prefill_tps=10000, tpot_ms=20, overhead_ms=5) for _ in "ab")
    seen = drive(aware.step_model, 2048, 800, seed=2, perfs=(aware, blind))
    late = seen[len(seen) // 2:]
    with_steps = p90([abs(f[0] - m) / m for _, m, f in late])
    without = p90([abs(f[1] - m) / m for _, m, f in late])
    assert with_steps < 0.75 * without, (with_steps, without)
    assert aware.ttft.theta[5] > 0.5


def warm(model: StepModel, steps: int, decodes: int = 10, sizes: tuple[int, ...] = (100,),
         cost=lambda tokens: 0.1) -> float:
    """``steps`` steps, each computing a prompt (of ``sizes`` in turn) sent during a
    decode-only step of 0.1 s before it, and lasting ``cost(tokens)``; returns the time
    of the last step's end."""
    now = 0.0
    model.token(now, decodes)
    for k in range(steps):
        size = sizes[k % len(sizes)]
        p = model.dispatched(size, now + 0.01, decodes)
        now += 0.1
        model.token(now, decodes)  # the prompt joins the step starting now ...
        now += cost(decodes + size)
        model.token(now, decodes)  # ... which computed it
        model.first_token(p, now)
    return now


def test_nothing_is_projected_before_steps_are_measured():
    model = StepModel()
    assert model.project(1000, 0, 0.0) == 0.0
    now = warm(model, MIN_STEPS - 1)
    assert model.project(1000, 0, now) == 0.0
    now = warm(model, 1)
    assert model.project(1000, 0, now) > 0.0


def test_a_first_token_answers_every_older_prompt():
    """First tokens leave in arrival order: one says every prompt before it is done,
    whatever the model thought was left of them."""
    model = StepModel()
    now = warm(model, MIN_STEPS)
    a = model.dispatched(5000, now + 0.01, 10)
    b = model.dispatched(5000, now + 0.02, 10)
    c = model.dispatched(5000, now + 0.03, 10)
    before = model.project(100, 10, now + 0.04)
    model.first_token(b, now + 0.05)
    assert not a.alive and not b.alive and c.alive
    assert model.project(100, 10, now + 0.05) < before
    assert model.after == [pytest.approx(5000.0)] * len(BUDGETS)


def test_a_prompt_that_leaves_unanswered_is_no_longer_ahead():
    model = StepModel()
    now = warm(model, MIN_STEPS)
    a = model.dispatched(3000, now + 0.01, 10)
    model.dispatched(500, now + 0.02, 10)
    model.dropped(a)  # cancelled, or moved to another engine
    model.dropped(a)  # twice is once
    assert model.after == [pytest.approx(500.0)] * len(BUDGETS)


def test_only_steps_that_computed_prompts_teach_the_step_length():
    """Decode-only steps are what a projection does not add up, and a gap with nothing
    planned may be idle time: neither teaches the step length."""
    model = StepModel()
    now = warm(model, MIN_STEPS)
    i = BUDGETS.index(model.budget)
    assert len(model.lengths[i]) == MIN_STEPS
    for _ in range(5):
        now += 0.03
        model.token(now, 10)  # decode-only steps
    model.token(now + 60, 0)  # a minute later, after an idle gap
    assert len(model.lengths[i]) == MIN_STEPS
    assert model.lengths[i].seconds(110) == pytest.approx(0.1)


def test_the_prompts_followed_are_bounded():
    model = StepModel()
    for i in range(MAX_QUEUE + 10):
        model.dispatched(10, float(i), 0)
    assert len(model.queue) == MAX_QUEUE
    assert model.after[0] == pytest.approx(10 * MAX_QUEUE)


def test_answered_prompts_leave_the_queue_even_when_no_step_starts():
    """An engine whose tokens never pause (a gap never opens) starts no step, which is
    where the queue's dead head is swept: a first token takes the prompts it answers off
    the queue itself, so the next one does not walk them again."""
    model = StepModel()
    for i in range(1000):
        p = model.dispatched(10, float(i), 0)
        model.first_token(p, i + 0.5)
        assert len(model.queue) == 0
    a, b = model.dispatched(10, 2000.0, 0), model.dispatched(10, 2000.1, 0)
    model.dropped(a)  # cancelled: stays until swept or answered past
    model.first_token(b, 2001.0)
    assert len(model.queue) == 0 and model.judged == 1001


def test_near_ties_go_to_the_smaller_budget():
    """Budgets whose errors are within NEAR of the least count as as good, and the
    smallest of them projects: a budget too large projects a long backlog short (late
    requests), one too small projects it long (refusals). A clearly better budget wins."""
    model = StepModel()
    now = warm(model, MIN_STEPS)
    model.judged = 100
    model.errors = [0.65, 0.1155, 0.1118, 0.1118, 0.1118]  # the flip seen in a 1.5x run
    assert model.budget == 2048
    long_ahead = [model.project(8000, 200, now, i) for i in range(len(BUDGETS))]
    assert model.project(8000, 200, now) == long_ahead[1] > long_ahead[2]
    assert 0.11 * (1 + NEAR) < 0.20
    model.errors = [0.65, 0.20, 0.11, 0.11, 0.11]  # 4096 clearly better
    assert model.budget == 4096
    model.errors = [0.05, 0.054, 0.2, 0.2, 0.2]
    assert model.budget == 1024


def test_a_judged_step_model_floors_the_projection():
    """The staircase errs short only (it misses what arrives later), the fit's line can
    err short far past the backlogs it learned from: once the step model has been judged
    by enough first tokens, no projection is shorter than its own; before, it is a guess."""
    perf = PerfModel(prefill_tps=10000, tpot_ms=20, overhead_ms=5)
    fitted = perf.ttft_s(2000, 10)
    assert fitted < 5.0
    perf.step_model.judged = FLOOR_AFTER - 1
    assert perf.ttft_s(2000, 10, 0.0, 5.0) < 5.0
    perf.step_model.judged = FLOOR_AFTER
    assert perf.ttft_s(2000, 10, 0.0, 5.0) == 5.0
    assert perf.ttft_s(2000, 10, 0.0, 0.0) == pytest.approx(fitted)  # nothing measured


def test_the_step_under_way_is_what_its_plan_costs():
    """What is left of the step under way is its planned tokens at the learned length
    (a step computing prompts is longer than a decode-only one); unknown before steps
    have been measured. The estimate's projection is ``project``'s."""
    model = StepModel()

    def wait(now: float) -> float | None:
        estimate = model.estimate(100, 10, now)
        if estimate is not None:
            assert estimate[1] == pytest.approx(model.project(100, 10, now))
        return None if estimate is None else estimate[0]

    assert wait(0.0) is None
    now = warm(model, MIN_STEPS, sizes=(100, 500), cost=lambda tokens: 0.05 + 0.0005 * tokens)
    decode_only = wait(now + 0.01)
    assert decode_only == pytest.approx(0.05 + 0.0005 * 10 - 0.01)
    model.dispatched(1000, now + 0.01, 10)
    now += 0.05
    model.token(now, 10)  # a step starts, planned with the 1,000-token prompt
    loaded = wait(now + 0.01)
    assert loaded is not None and loaded > decode_only
    i = BUDGETS.index(model.budget)
    assert loaded == pytest.approx(model.lengths[i].seconds(1010) - 0.01)
    assert wait(now + 100) == 0.0  # overdue: it ends any moment
