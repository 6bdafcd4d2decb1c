"""Admission: the budget gate, the queue, slots; placement is ``placement.Pipeline`` and
every measurement goes to ``learning.Learning``.

Pure and synchronous: the exchange asks ``admit`` once its body is sized; the
scheduler answers dispatch-now, queued, or a refusal; slot releases (first token,
end of stream) pump the queue and return the tickets that can now be dispatched.
The queue's order is a policy (``_in_order``: arrival, or the least expected work
first); a ticket that waits holds back later ones only on the engines it could use
(``pump``).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..config import Config
from . import errors
from .chat_prompt import PromptIds
from .engines import EngineState
from .errors import HttpError
from .kv_events import PromptKeys
from .learning import Learning
from .outputs import Key, OutputLengths, system_hash
from .placement import FILTERS, Candidate, Pipeline, extrapolated, project
from .pool import Pool
from .prefix import BLOCK_BYTES, Chain, prompt_blocks, reply_blocks
from .steps import Prefill

# What a ticket's prompt hashes hold, counted with its request against
# serving.max_held_bytes (measured: a 1 MB prompt's 15,625 block hashes held 692 KB): a
# block's hash is a Python int (36 bytes) and its place in a list (8); with KV events, a
# prompt token's ID (4) and its share of its block's chain key (44 every 16 tokens), until
# the request is placed.
BLOCK_HELD = 44
PROMPT_ID_HELD = 8


@dataclass(frozen=True, slots=True)
class PromptFacts:
    """A prompt's prefix-index blocks (their hashes, its length and a block's in the
    index's unit, where its chain stops) and, with KV events, its exact token IDs."""

    blocks: list[int]
    units: int
    block_units: int
    chain: Chain | None
    ids: PromptKeys | None


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
    work_ahead: float = 0.0  # the TTFT model's features at dispatch: work ahead + own,
    decodes_at_dispatch: int = 0  # and the sequences sharing the engine's steps,
    step_wait: float = 0.0  # and what was left of its step under way,
    steps_s: float = 0.0  # and the step model's projection
    prefill: Prefill | None = None  # its handle in the engine's step model until answered
    predicted_ttft_s: float | None = None  # client-level projection at admission
    calibration_epoch: int = 0  # its engine's calibration's when it was placed
    placed_idle: bool = False  # placed on an idle engine: judges the idle margins
    first_token_at: float | None = None
    done: bool = False
    # Endpoints the request may go to (a gateway's subset hint); None: any.
    candidates: frozenset[str] | None = None
    tpot_budget_s: float | None = None
    predicted_output: int = 0
    # Its expected engine work (``admission.queue_order`` "least-work"): uncached prompt
    # tokens on its best engine plus its predicted output at admission.output_token_work.
    work_order: float = 0.0
    alone_s: float = 0.0  # its projection on an idle engine: the least TTFT it may see
    output_keys: list[Key] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # prompt block hashes (prefix index)
    # The prompt's token IDs as the engine computes them (only where KV events are used),
    # until it is placed.
    prompt_ids: PromptKeys | None = None
    predicted_cached: int = 0  # prompt tokens expected cached on the engine it got
    prompt_units: int = 0  # the prompt's length in the index's unit (bytes or tokens)
    block_units: int = 64  # and one block's
    chain: Chain | None = None  # where the prompt's chain stops: its reply continues it
    # Ranked engines Envoy may retry on if ``engine`` does not answer (endpoint picker).
    fallbacks: tuple[EngineState, ...] = ()
    failover: bool = False  # served by a fallback: its TTFT is no sample of either engine
    # Set when the queue gives the request up: no engine can meet its budget any more.
    refusal: HttpError | None = None
    # Its objective's (``admission.objectives``): queued, a higher one goes first; a
    # negative one is shed rather than queued.
    priority: int = 0
    # Its flow (x-gateway-inference-fairness-id; "" for none): with admission.fairness
    # round-robin, the flows of one priority take freed slots in turn.
    flow: str = ""
    # With fairness: how many of its flow's queued requests went before it when it was
    # projected to join (``queue_wait_s``): a later arrival of another flow with fewer
    # takes its turn before it.
    flow_rank: int = 0

    def held(self) -> int:
        """About the bytes its prompt's hashes hold (``BLOCK_HELD``)."""
        n = BLOCK_HELD * len(self.blocks)
        if self.prompt_ids is not None:
            n += PROMPT_ID_HELD * len(self.prompt_ids)
        return n


DRAIN_WINDOW = 64  # dispatches from the queue that set its measured drain rate
DRAIN_MIN = 8  # before the rate is trusted
# The most of a queue's drain rate that later arrivals served first may be projected to
# take (``queue_wait_s``): at or past it the request would wait for ever, which the
# projection caps at ten times its wait with no one overtaking it.
OVERTAKEN_MAX = 0.9
LOOKAHEAD = 32  # waiting tickets a pump walks past before it stops (see ``pump``)


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
    def __init__(self, config: Config, pool: Pool, learning: Learning) -> None:
        self.config = config
        self.pool = pool
        self.learning = learning
        self.pipeline = Pipeline(config.scheduler)
        self.least_work = config.admission.queue_order == "least-work"  # else FIFO
        self.queue: deque[Ticket] = deque()
        self.tokenizer: Any = None  # sizing.tokenizer's, for the prefix index (router sets)
        self.prompt_ids: PromptIds | None = None  # with KV events: exact prompt IDs
        self.queued_tokens = 0
        self.prioritized = 0  # queued tickets with a priority other than 0
        # admission.fairness round-robin: the flow each priority last dispatched from the
        # queue (the turn passes to the next flow by name); at most one per priority.
        self.fair = config.admission.fairness == "round-robin"
        self.last_flow: dict[int, str] = {}
        # Queued requests given up once no engine could meet their budgets any more
        # (``pump``): admitted on a projection that later arrivals, served first (a
        # higher priority, less work, another flow's turn), made wrong. Why counted apart
        # from admission's refusals (both answer 429 ttft_budget_exceeded): these waited
        # for nothing, and their share says how far the queue's projections hold.
        self.gave_up = 0
        # When recent requests left the queue since it last formed: its measured drain
        # rate (a queue emptied by dispatch or by clients leaving alike). Charging the
        # queue at prefill speed alone misses the engines' own limits (a full decode
        # batch drains the queue only as decodes finish).
        self.drained: deque[float] = deque(maxlen=DRAIN_WINDOW)
        # When recent requests joined the queue since it last formed, with their priority,
        # work order, flow and rank in it: how often a later arrival is served before a
        # joining request (``queue_wait_s``).
        self.joined: deque[tuple[float, int, float, str, int]] = deque(maxlen=DRAIN_WINDOW)
        self.ranked_joined_at = -math.inf  # the last join with a priority other than 0
        # id() of the engines the last pump saw that no waiting ticket could still use
        # (none when its walk stopped at ``LOOKAHEAD``: the tickets past it claim what
        # they claim): a request arriving behind the queue may go there at once.
        self.unclaimed: set[int] = set()

    # -- admission -----------------------------------------------------------------
    def prompt_facts(self, chat: bool, body: dict[str, Any]) -> PromptFacts:
        """What the prompt's text tells placement: with a tokenizer, the costly part of
        admission. Reads only configuration and the request: safe to run in a thread,
        which is where a long prompt's is run (``Exchange.measure``)."""
        blocks, units, block_units, chain = [], 0, BLOCK_BYTES, None
        if self.config.scheduler.prefix_index_blocks:
            blocks, units, block_units, chain = prompt_blocks(body, self.tokenizer)
        ids = None
        # A salted prompt's blocks are reported with their salt, which the exact match
        # does not model: its prefix is the index's (salted there) or the hit rate's.
        if self.prompt_ids is not None and body.get("cache_salt") is None:
            found = self.prompt_ids.ids(body, chat)
            if found:
                ids = PromptKeys(found)
        return PromptFacts(blocks, units, block_units, chain, ids)

    def annotate(self, t: Ticket, chat: bool, body: dict[str, Any],
                 max_tokens: int | None, facts: PromptFacts) -> None:
        """What admission and placement know of a request beyond its size: its predicted
        output length, and its prompt's facts (``prompt_facts``)."""
        t.output_keys = OutputLengths.keys(chat, system_hash(body), max_tokens, t.tokens)
        t.predicted_output = self.learning.outputs.predict(t.output_keys, max_tokens)
        t.blocks, t.prompt_units, t.block_units, t.chain = (
            facts.blocks, facts.units, facts.block_units, facts.chain)
        if facts.ids is not None:
            t.prompt_ids = facts.ids
            t.tokens = len(facts.ids)  # exact, where the estimate was an estimate

    def admit(self, t: Ticket, now: float) -> Decision:
        engines = self.pool.serviceable(now, t.candidates)
        if not engines:
            return Refuse(errors.backend_unavailable())
        # Queued work (if any) goes to the engines in proportion to their speed (the
        # rates only then: they are a walk of the pool's models per request).
        shares = [0.0] * len(engines)
        queued = self.queued_tokens
        fair_ahead: list[Ticket] | None = None
        if queued and self.fair:  # only what goes before it (its work order unknown yet)
            fair_ahead = self._fair_ahead(t, known_work=False)
            queued = sum(q.tokens for q in fair_ahead)
            if self.least_work:  # its work order, set below, may put fewer before it
                fair_ahead = None
        elif queued and (self.prioritized or t.priority):  # only what it will not overtake
            queued = sum(q.tokens for q in self.queue if q.priority >= t.priority)
        if queued:
            rates = [min(1e9, e.model.learned_prefill_tps) for e in engines]
            total = sum(rates)
            shares = [queued * r / total for r in rates]
        projections = [project(e, t, share, now)
                       for e, share in zip(engines, shares, strict=True)]
        cands = projections
        predictive = self.config.admission.mode == "predictive"
        if predictive and "kv-headroom" in self.config.scheduler.filters:
            room = FILTERS["kv-headroom"](t, cands, self.config.scheduler)
            if not room:
                return Refuse(errors.engines_saturated())
            cands = room
        if predictive and "verified-backlog" in self.config.scheduler.filters:
            # judged where it may be placed (the placement filter's own rule)
            cands = FILTERS["verified-backlog"](t, cands, self.config.scheduler)
        if predictive and t.tpot_budget_s is not None:
            fit = FILTERS["tpot-budget"](t, cands, self.config.scheduler)
            if not fit:
                return Refuse(errors.tpot_over_budget(min(c.tpot_s for c in cands),
                                                      t.tpot_budget_s))
            cands = fit
        adm = self.config.admission
        if self.least_work:
            t.work_order = (min(c.work for c in cands)
                            + adm.output_token_work * t.predicted_output)
        waiting = self.queue_wait_s(now, t, fair_ahead)
        projected = min(c.ttft_s for c in cands) + waiting
        t.predicted_ttft_s = projected
        if predictive:
            alone = min(c.engine.model.ttft_s(
                c.work, 0, 0.0, c.engine.model.step_model.project(c.work, 0, now, idle=True))
                for c in cands)
            if alone > t.budget_s:
                return Refuse(errors.prompt_too_long(alone, t.budget_s))
            t.alone_s = alone
            calibrated = min(c.ttft_margin_s for c in cands) + waiting
            if calibrated > t.budget_s:
                engine = self._beside_queue(t, now, predictive)
                if engine is not None:
                    return Dispatch(engine)
                return Refuse(errors.projected_over_budget(calibrated, t.budget_s))
        if not self.queue:  # then nothing is queued: the projections are placement's too
            engine = self._place(t, now, projections, predictive)
        else:
            engine = self._beside_queue(t, now, predictive)
        if engine is not None:
            return Dispatch(engine)
        if t.priority < 0:  # sheddable: served now or not at all
            return Refuse(errors.request_shed(t.priority))
        if len(self.queue) >= adm.queue_limit:
            return Refuse(errors.queue_full())
        max_wait_s = adm.max_wait_ms / 1000
        if predictive and waiting > max_wait_s:
            # A budget longer than the queue may hold a request (x-slo-ttft-ms past
            # admission.max_wait_ms): queued, it would wait out max_wait_ms and end 504;
            # refused now, the client is told when to come back.
            return Refuse(errors.queue_wait_over_limit(waiting, max_wait_s))
        if not self.queue:
            self.drained.clear()  # a new queue: its rates are its own
            self.joined.clear()
        t.queued_at = now
        self.joined.append((now, t.priority, t.work_order, t.flow, t.flow_rank))
        self.queue.append(t)
        if t.priority:
            self.prioritized += 1
            self.ranked_joined_at = now
        self.unclaimed.difference_update(id(e) for e in engines)  # until a pump says
        self.queued_tokens += t.tokens
        return Queued()

    def _beside_queue(self, t: Ticket, now: float, keep_budget: bool) -> EngineState | None:
        """Place a request arriving behind a queue on an engine that no waiting request
        claims, as the queue's next pump would (``pump``): there it waits for nothing
        queued, so its projection is the engine's alone, not the queue's drain time
        (which admission charges where the queued requests go first). Why: measured at
        1.5x (one run, ``--warmup 60 --duration 120``), 315 of the 1,018 refusals made
        behind a queue had an engine with a free slot (the l4 in 264 of them) where the
        request's calibrated projection, without the queue's ~5 s median drain time
        (dilated), met the budget: refused where the pump would have placed it at once
        (with this, +4-7% goodput in two alternated pairs of 1.5x cells). None: it
        joins the queue (or is refused) as before."""
        if not self.unclaimed or not self.queue:
            return None
        free = [project(e, t, now=now) for e in self.pool.serviceable(now, t.candidates)
                if id(e) in self.unclaimed]
        return self._place(t, now, free, keep_budget) if free else None

    def queue_wait_s(self, now: float, t: Ticket | None = None,
                     fair_ahead: list[Ticket] | None = None) -> float:
        """How long request ``t`` joining the queue now waits before it is dispatched:
        behind every queued request in FIFO order, or (least-work order) behind those
        with no more work than its own, at the rate this queue (since it last emptied)
        has drained: 0 with nothing ahead or too few dispatches to say.

        Later arrivals served before it (a higher priority; in the least-work order, less
        work; under ``admission.fairness``, another flow's with fewer of its flow queued
        before it than ``t`` has of its own) take their turns while it waits: at ``d``
        seconds a dispatch, ``ahead`` before it and ``r`` such arrivals a second (those
        that joined the queue lately), it waits W = ahead x d + r x W x d, so W = ahead x
        d / (1 - r x d) (``_overtaking_rate``; ``OVERTAKEN_MAX`` caps r x d). Why:
        counting only those queued now, the least-work order projected an expensive
        request's wait as if nothing would overtake it, admitted it, and gave it up from
        the queue once its budget ran out: half that order's refusals on real vLLM came
        after such a wait (docs/measurements.md, "The queue's overtakers").
        ``fair_ahead``: what ``_fair_ahead(t)`` gives, where the caller has it already."""
        if not self.queue:
            return 0.0
        if t is not None and self.fair:  # its rank in its flow is recorded as it joins
            if fair_ahead is None:
                fair_ahead = self._fair_ahead(t)
            t.flow_rank = sum(1 for q in fair_ahead
                              if q.flow == t.flow and q.priority == t.priority)
        d = self.drained
        if len(d) < DRAIN_MIN:
            return 0.0
        ahead = len(self.queue)
        overtaken = False
        if fair_ahead is not None:
            ahead = len(fair_ahead)
            overtaken = True
        elif t is not None and (self.prioritized or t.priority):  # a lower priority is not ahead
            least_work = self.least_work
            ahead = sum(1 for q in self.queue if q.priority > t.priority or (
                q.priority == t.priority and (not least_work or q.work_order <= t.work_order)))
            overtaken = True
        elif t is not None and self.least_work:
            ahead = sum(1 for q in self.queue if q.work_order <= t.work_order)
            overtaken = True
        elif t is not None and self.joined:  # FIFO: higher priorities that joined lately
            overtaken = self.ranked_joined_at >= self.joined[0][0]
        interval = (d[-1] - d[0]) / (len(d) - 1)
        wait = ahead * interval
        if overtaken and wait:
            assert t is not None
            wait /= 1 - min(OVERTAKEN_MAX, self._overtaking_rate(now, t) * interval)
        return wait

    def _overtaking_rate(self, now: float, t: Ticket) -> float:
        """How many requests a second have lately joined the queue that would be served
        before ``t`` had they joined after it (a higher priority; in the least-work order
        less work, equal work going in arrival order; with fairness, another flow's with
        a lower rank in its flow than ``t``'s in its own, ties left out as the turns
        decide them); 0 until ``DRAIN_MIN`` joined."""
        joined = self.joined
        span = now - joined[0][0] if len(joined) >= DRAIN_MIN else 0.0
        if span <= 0:
            return 0.0
        priority, work, least_work = t.priority, t.work_order, self.least_work
        if self.fair:
            flow, rank = t.flow, t.flow_rank
            return sum(1 for _, p, w, f, r in joined if p > priority or p == priority and (
                r < rank if f != flow else least_work and w < work)) / span
        return sum(1 for _, p, w, _, _ in joined if p > priority or (
            p == priority and least_work and w < work)) / span

    def _place(self, t: Ticket, now: float, projections: list[Candidate],
               keep_budget: bool = False) -> EngineState | None:
        """Place on the best engine the pipeline allows. ``keep_budget``: only on an engine
        whose calibrated projection still meets the request's TTFT budget, counting the
        time it has waited; the engine that admission judged may have no free slot, and
        a slower one with a slot would break the promise. None: wait (in the queue) for a
        slot where the budget can be met."""
        ranked = self.pipeline.rank(t, projections)
        if keep_budget and ranked:
            waited = now - t.arrival
            ranked = [c for c in ranked if waited + c.ttft_margin_s <= t.budget_s]
            if (ranked and "verified-backlog" in self.config.scheduler.filters
                    and all(extrapolated(c) for c in ranked)):
                # Every engine it could go to is past what its measurements have checked:
                # its projection there is an extrapolation that has run 2x short (the
                # only engine left when the fastest reached its sequence cap). Wait in
                # the queue: the first tokens of the backlog verify more or drain it.
                return None
        if not ranked:
            return None
        picked = ranked[0]
        t.fallbacks = tuple(c.engine for c in ranked[1:1 + self.config.scheduler.fallbacks])
        e = picked.engine
        t.engine = e
        t.dispatched_at = now
        if t.predicted_ttft_s is not None:  # the projection of the engine it got
            t.predicted_ttft_s = picked.ttft_s + (now - t.arrival)
        t.work = picked.work
        t.placed_idle = e.idle()
        t.calibration_epoch = e.margins(t.placed_idle).epoch
        t.predicted_cached = round(picked.cached * t.tokens)
        if t.blocks or t.prompt_ids:
            e.prompt_sent(t.tokens, picked.cached)
        if e.kv is not None:
            e.kv.dispatched(now, t.prompt_ids)
        t.prompt_ids = None  # placed: only the prefix index's blocks are used from now
        _book(e, t)
        t.work_ahead = e.prefill_work
        t.decodes_at_dispatch = e.decode + e.prefill - 1  # as projected (placement.project)
        t.step_wait = picked.step_wait_s
        t.steps_s = picked.steps_s
        t.prefill = e.model.step_model.dispatched(t.work, now, e.decode)
        return e

    def place_passthrough(self, now: float, candidates: frozenset[str] | None
                          ) -> list[EngineState]:
        """A request Narwhal does not meter (``GET /v1/models``): the same pipeline, for
        an empty prompt. The chosen engine and its fallbacks; empty: none may serve."""
        t = Ticket(None, 0, now, 0.0, now, candidates=candidates)
        ranked = self.pipeline.rank(t, [project(e, t) for e in
                                        self.pool.serviceable(now, candidates)])
        return [c.engine for c in ranked[:1 + self.config.scheduler.fallbacks]]

    def served_by(self, t: Ticket, endpoint: str) -> EngineState | None:
        """Envoy reports the engine that answered (the endpoint picker's served endpoint).
        When a fallback answered because the chosen engine did not, move the request's
        slot, work and predicted decode there: the accounting follows the engine that
        serves. Returns the engine it moved to, or None (no move)."""
        old = t.engine
        if old is None or t.done or t.first_token_at is not None or endpoint == old.endpoint:
            return None
        new = next((e for e in t.fallbacks if e.endpoint == endpoint), None)
        if new is None:  # Envoy's own fallback policy: any engine of the pool
            new = next((e for e in self.pool.engines if e.endpoint == endpoint), None)
        if new is None:
            return None
        _unbook(old, t)
        old.failovers += 1
        _book(new, t)
        t.engine = new
        t.failover = True
        if old.retired and old.in_flight == 0:
            self.pool.sweep()
        return new

    def _in_order(self) -> list[Ticket]:
        """The queue in the order its tickets take freed slots (``admission.queue_order``):
        arrival (FIFO), or the least expected engine work first, arrival order among
        equals. Why least work: under a sustained overload the engines are full whatever
        they are given, so how many requests they finish a second is set by what each
        costs them (its prefill, and a sequence held as long as it decodes); served
        cheapest first, the same engines finish more requests within their budgets
        (docs/measurements.md, "Twenty-sixth session"). Queued requests of a higher
        priority (``admission.objectives``) come before any of a lower, in that order
        among themselves. With ``admission.fairness: round-robin`` the flows of one
        priority then take turns (``_fair_order``)."""
        order = self._queue_order()
        return self._fair_order(order) if self.fair else order

    def _queue_order(self) -> list[Ticket]:
        """``_in_order`` before the flows' turns."""
        if self.least_work:
            return sorted(self.queue, key=_ranked_work if self.prioritized else _work_order)
        if self.prioritized:
            return sorted(self.queue, key=_priority_first)  # stable: FIFO within one
        return list(self.queue)

    def _fair_order(self, order: list[Ticket]) -> list[Ticket]:
        """Round-robin between the flows of each priority, as the Inference Extension's
        flow control does (x-gateway-inference-fairness-id): the band's flows in name
        order from the one after the flow it last dispatched, each flow's first ticket,
        then each one's second, and so on, every flow's own in ``order``. Why: in one
        queue order a client that sends many requests at once is ahead of everyone who
        comes after it, and predictive admission refuses the others for the wait it
        causes; in turns each flow waits behind at most as many of another's requests
        as it has queued itself. One sort a band, by (rank in its flow, its flow's turn):
        the flows' names are the clients' to choose, and walking rank by rank over every
        flow cost ~0.5 ms a pump with 128 flows of one request beside one of 128."""
        out: list[Ticket] = []
        i = 0
        while i < len(order):
            priority = order[i].priority
            j = i
            while j < len(order) and order[j].priority == priority:
                j += 1
            band = order[i:j]
            turn = {name: k for k, name in enumerate(self._turns({q.flow for q in band},
                                                                   priority))}
            ranks: dict[str, int] = {}
            keys = []
            for q in band:
                rank = ranks.get(q.flow, 0)
                ranks[q.flow] = rank + 1
                keys.append((rank, turn[q.flow]))
            out.extend(band[k] for k in sorted(range(len(band)), key=keys.__getitem__))
            i = j
        return out

    def _turns(self, flows: Iterable[str], priority: int) -> list[str]:
        """The band's flows in the order of their turns: by name, from the one after the
        flow it last dispatched."""
        names = sorted(flows)
        start = bisect.bisect_right(names, self.last_flow[priority]) if (
            priority in self.last_flow) else 0
        return names[start:] + names[:start]

    def _fair_ahead(self, t: Ticket, known_work: bool = True) -> list[Ticket]:
        """The queued tickets that ``_fair_order`` puts before ``t`` were it to join: every
        one of a higher priority; of its own flow, those before it in queue order; of
        another flow of its priority, as many as take turns before its own comes (its
        rank in its flow, one more for a flow whose turn precedes its flow's).
        ``known_work`` False: ``t``'s work order is not set yet (admission's queued tokens,
        which the projections that set it need), so in the least-work order its whole
        flow counts as before it, as every ticket of its priority does without fairness."""
        own: list[Ticket] = []
        others: dict[str, list[Ticket]] = {}
        ahead = []
        for q in self._queue_order():
            if q.priority > t.priority:
                ahead.append(q)
            elif q.priority == t.priority:
                if q.flow != t.flow:
                    others.setdefault(q.flow, []).append(q)
                elif not (self.least_work and known_work) or q.work_order <= t.work_order:
                    own.append(q)
        rank = len(own)
        turn = self._turns([*others, t.flow], t.priority)
        before = set(turn[:turn.index(t.flow)])
        for name, tickets in others.items():
            ahead += tickets[:rank + (name in before)]
        return ahead + own

    def pump(self, now: float, if_slot_free: bool = False) -> list[Ticket]:
        """Dispatch queued tickets in queue order (``_in_order``; oldest first by
        default) while an engine has a slot. A ticket
        that must wait claims the engines where it could still meet its budget (every
        engine it may use, without predictive admission); a later ticket is placed only
        on an engine no earlier waiting one claims. Why not stop at the first that waits
        (strict FIFO, as before): the oldest tickets have waited longest, so often only
        the fastest engine can still meet their budgets, and while it had no slot they
        held back every younger request that a slower engine with free slots could have
        served within its own budget (a 1.5x run: 80-90 queued while the a100 and the l4
        computed no prefill for seconds, ~1,350 of ~2,000 blocked pumps so). Nothing
        overtakes a ticket on an engine it could use: each pump starts at the queue's
        first, so a slot freed there is its. ``LOOKAHEAD`` bounds the walk (a projection per engine
        per ticket).

        Predictive admission gives up a queued request once no engine could meet its
        budget any more (``Ticket.refusal``, a 429 with the overrun): placed, it would be
        served late on capacity that later requests need in budget. Both kinds come
        back, in the order decided.

        ``if_slot_free``: called where what changed may at most have freed a slot (a
        request joined the queue, or one released what it held): with none free nothing
        can be placed, and the refusals wait for the next pump that walks (a first token
        freeing a prefill slot, a command: every telemetry round pumps), as they did
        before joining pumped at all. Without this check the walk's projections cost ~6%
        of Narwhal's CPU per non-streaming request on the datapath bench's default
        configuration, where requests queue behind full slots (379-395 against 352-374
        us; with it at joins, 371-373 against 352-384); at releases, whose freed decode
        slot is rarely the one missing, 0.38 walks a request of 2.5 pumps (``bench.
        messages --clients 8``: 8 clients over the 4 prefill slots), ~1% of a request's
        bytecode instructions."""
        out: list[Ticket] = []
        if not self.queue:
            return out
        engines = self.pool.serviceable(now)
        predictive = self.config.admission.mode == "predictive"
        cfg = self.config.scheduler
        slots = "has-slot" in cfg.filters
        if if_slot_free and slots and not self._any_slot(engines):
            return out
        claimed: set[int] = set()  # id() of engines an earlier waiting ticket may still use
        waiting = 0
        for t in self._in_order():
            projections = [project(e, t, now=now) for e in engines]
            allowed = [c for c in projections
                       if t.candidates is None or c.engine.endpoint in t.candidates]
            waited = now - t.arrival
            best = min((c.ttft_margin_s for c in allowed), default=None)
            keep = predictive and best is not None
            if keep and waited + best > t.budget_s:
                t.refusal = errors.projected_over_budget(waited + best, t.budget_s,
                                                         _queued_s(t, now))
            # Wait for a slot where the budget can be met; in open mode, once none could
            # meet it, the best slot now.
            elif self._place(t, now, [c for c in projections if id(c.engine) not in claimed],
                             keep) is None:
                claimed.update(id(c.engine) for c in allowed
                               if not keep or waited + c.ttft_margin_s <= t.budget_s)
                waiting += 1
                open_ = [e for e in engines if id(e) not in claimed]
                if waiting >= LOOKAHEAD:  # the tickets past the walk may claim any engine
                    claimed.update(id(e) for e in engines)
                    break
                if not open_ or (slots and not self._any_slot(open_)):
                    break  # nothing left that a later ticket could take
                continue
            self._take(t, now, out)
        if predictive and self.least_work:
            # The walk may never reach the requests with the most work while less keeps
            # arriving (it stops at LOOKAHEAD, or where no engine is left): give up those
            # that could not meet their budgets on an idle engine any more, rather than
            # hold them to admission.max_wait_ms or their deadlines.
            for t in [q for q in self.queue if now - q.arrival + q.alone_s > q.budget_s]:
                t.refusal = errors.projected_over_budget(now - t.arrival + t.alone_s,
                                                         t.budget_s, _queued_s(t, now))
                self._take(t, now, out)
        self.unclaimed = {id(e) for e in engines if id(e) not in claimed}
        return out

    def _take(self, t: Ticket, now: float, out: list[Ticket]) -> None:
        """``t`` leaves the queue, dispatched or refused (``Ticket.refusal``)."""
        self.dequeue(t)
        self.drained.append(now)
        out.append(t)
        if t.refusal is not None:
            self.gave_up += 1
        elif self.fair:  # its flow had its turn
            self.last_flow[t.priority] = t.flow

    def _any_slot(self, engines: list[EngineState]) -> bool:
        return any(e.has_slot(self.config.scheduler) for e in engines)

    def queued_by_priority(self) -> dict[int, int]:
        """How many requests wait at each priority (``admission.objectives``)."""
        if not self.prioritized:
            return {0: len(self.queue)} if self.queue else {}
        counts: dict[int, int] = {}
        for t in self.queue:
            counts[t.priority] = counts.get(t.priority, 0) + 1
        return counts

    def queued_flows(self) -> int:
        """How many flows (fairness IDs) have a request waiting; those naming none are
        one flow."""
        return len({t.flow for t in self.queue})

    def dequeue(self, t: Ticket) -> None:
        if t.queued_at is not None:
            self.queue.remove(t)
            self.queued_tokens -= t.tokens
            if t.priority:
                self.prioritized -= 1
            t.queued_at = None

    # -- slots -----------------------------------------------------------------------
    def first_token(self, t: Ticket, now: float) -> None:
        e = t.engine
        if e is None or t.first_token_at is not None:
            return
        t.first_token_at = now
        _end_prefill(e, t)
        e.decode += 1
        self.learning.first_token(t, now)

    def release(self, t: Ticket, output_tokens: int | None = None,
                last_token_at: float = 0.0, reply: str | None = None) -> None:
        """The request ended; ``output_tokens`` when it completed with identified output,
        and when its last token came; ``reply``, its generated text, when it completed."""
        if t.done:
            return
        t.done = True
        self.dequeue(t)
        e = t.engine
        if e is None:
            return
        if t.first_token_at is None:
            _end_prefill(e, t)
            _drop_prefill(e, t)
        else:
            e.decode -= 1
        e.decode_backlog = max(0, e.decode_backlog - t.predicted_output)
        if output_tokens is not None:
            self.learning.completed(t, output_tokens, last_token_at)
        if reply is not None and t.chain is not None and e.prefix.capacity:
            # The engine caches the reply where it generated it: the conversation's next
            # turn carries it. Tail first, so that the tail is evicted before the prefix
            # (as the engine evicts, and a chain missing its prefix matches nothing).
            blocks = t.blocks + reply_blocks(t.chain, reply, self.tokenizer)
            e.prefix.insert(blocks[::-1])
        if e.retired and e.in_flight == 0:
            self.pool.sweep()


def _priority_first(t: Ticket) -> int:
    return -t.priority


def _ranked_work(t: Ticket) -> tuple[int, float]:
    return -t.priority, t.work_order


def _work_order(t: Ticket) -> float:
    return t.work_order


def _book(e: EngineState, t: Ticket) -> None:
    """What a request placed on ``e`` holds there until its first token: a prefill slot,
    its uncached prompt as work ahead of later requests, its predicted output as decode
    backlog; and its prompt's blocks join the engine's prefix index."""
    e.prefill += 1
    e.dispatched += 1
    e.prefill_work += t.work
    e.decode_backlog += t.predicted_output
    if t.blocks:
        e.prefix.insert(t.blocks)


def _queued_s(t: Ticket, now: float) -> float:
    """How long a queued ticket has waited in the queue (its refusal's message says)."""
    return now - (t.queued_at if t.queued_at is not None else t.arrival)


def _end_prefill(e: EngineState, t: Ticket) -> None:
    """The request no longer prefills on ``e`` (first token, end, or moved): its slot and
    its uncached prompt are no longer ahead of the next request."""
    e.prefill -= 1
    e.prefill_work = max(0.0, e.prefill_work - t.work)


def _drop_prefill(e: EngineState, t: Ticket) -> None:
    """The engine will compute no more of the request's prompt (it ended, or moved)."""
    if t.prefill is not None:
        e.model.step_model.dropped(t.prefill)
        t.prefill = None


def _unbook(e: EngineState, t: Ticket) -> None:
    """Undo ``_book``: the request did not go to ``e`` after all (a fallback served)."""
    _end_prefill(e, t)
    _drop_prefill(e, t)
    e.dispatched -= 1
    e.decode_backlog = max(0, e.decode_backlog - t.predicted_output)


__all__ = ["Candidate", "Decision", "Dispatch", "Queued", "Refuse", "Scheduler", "Ticket"]
