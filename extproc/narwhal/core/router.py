"""The router's shared state: configuration, scheduler, accounting, serving state.

Sans-I/O like the rest of the core: nothing here sends, sleeps or schedules. Requests
the scheduler dispatches from its queue collect in ``dispatched`` for the adapters to
send (``take_dispatched``), and exchanges whose long prompt is to be tokenized off the
event loop in ``measuring`` (``take_measuring``); commands that change who may take work (maintenance,
fencing, a health round, a profile) change state, pump the queue and notify the
listeners, which is where an adapter learns that there is work to send.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..config import Config
from .accounting import Accounting
from .chat_prompt import PromptIds
from .closes import CloseVerdicts
from .control import Control
from .engines import EngineState
from .leadership import Leadership
from .learning import Learning
from .pool import Pool
from .scheduler import Scheduler, Ticket
from .sizing import Sizer

if TYPE_CHECKING:
    from .exchange import Exchange


def default_identity() -> str:
    """A leader-election identity unique to this process: a restarted replica must not
    inherit its predecessor's lease (client-go's hostname + random suffix)."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class Router:
    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.wall = wall  # only for what is logged for other processes to compare
        self.pool = Pool(config)
        self.learning = Learning(self.pool)
        self.scheduler = Scheduler(config, self.pool, self.learning)
        self.sizer = Sizer(config.sizing.bytes_per_token, config.sizing.tokenizer)
        self.scheduler.tokenizer = self.sizer.tokenizer  # prefix blocks in tokens, if any
        if self.sizer.tokenizer is not None and config.kv_events:
            # Matching an engine's reported blocks needs the prompt's exact token IDs.
            self.scheduler.prompt_ids = PromptIds.load(self.sizer.tokenizer,
                                                       config.sizing.tokenizer)
        self.accounting = Accounting()
        # Priorities by objective name, as requests are admitted: admission.objectives,
        # under the pool's InferenceObjectives where discovery follows them.
        self.objectives: dict[str, int] = dict(config.admission.objectives)
        self.held = 0  # requests inside the HTTP retention limit
        self.held_bytes = 0  # what they hold against serving.max_held_bytes
        self.draining = False
        self.fenced = False
        self.started = False  # the first telemetry round has completed
        self.heartbeat: float | None = None  # when the last telemetry round completed
        self.listeners: list[Callable[[], None]] = []
        # Queued requests the scheduler placed, for the adapters to send upstream.
        self.dispatched: list[Ticket] = []
        # Exchanges whose long prompt waits to be tokenized off the event loop (their
        # ``measure``, then ``measured``), for the adapters to run.
        self.measuring: list[Exchange] = []
        self.closes = CloseVerdicts(config.telemetry.close_verdict_ms / 1000)
        # What exchanges do to this state after dispatch (a worker process swaps in one
        # that sends it to the scheduler process).
        self.control: Control = Control(self)
        le = config.router.leader_election
        # None: the role comes from config alone. Else the Lease decides, per request.
        self.leadership: Leadership | None = (
            Leadership(le.identity or default_identity(), le.lease_duration_ms / 1000,
                       le.renew_deadline_ms / 1000, le.retry_period_ms / 1000)
            if le.enabled else None)

    @property
    def engines(self) -> list[EngineState]:
        return self.pool.engines

    def engine(self, name: str) -> EngineState | None:
        return next((e for e in self.engines if e.name == name), None)

    def changed(self) -> None:
        """Serving state may have changed (health round, drain, admin): tell the listeners."""
        for listener in self.listeners:
            listener()

    def not_ready_reason(self) -> str | None:
        """Why the router refuses to serve now, or None when it serves."""
        if self.draining:
            return "draining"
        if self.config.router.role == "standby":
            return "standby"
        if self.fenced:
            return "fenced"
        if self.leadership is not None:
            reason = self.leadership.reason(self.clock())
            if reason is not None:
                return reason
        if not self.started:
            return "starting"
        if self.pool.any_serviceable(self.clock()):
            return None  # then none of the pool-wide reasons below holds
        if self.pool.all_in_maintenance():
            return "maintenance"
        if self.pool.all_stale(self.clock()):
            return "monitoring-degraded"
        if self.pool.all_unprofiled(self.clock()):
            return "profiling"
        return None

    def live(self) -> bool:
        """False once background telemetry has not completed a round for three intervals
        (and at least the staleness window): the process cannot recover by itself."""
        if self.heartbeat is None:
            return True  # no telemetry loop (pure tests)
        cfg = self.config.telemetry
        window = max(3 * cfg.health_interval_ms, cfg.stale_after_ms) / 1000
        return self.clock() - self.heartbeat <= window

    def pump(self, if_slot_free: bool = False) -> None:
        """Place what the queue holds where slots are free; the placed (and the given
        up, ``Ticket.refusal``) wait in ``dispatched`` until an adapter takes them.
        ``if_slot_free``: only a slot may have come free (``Scheduler.pump``)."""
        placed = self.scheduler.pump(self.clock(), if_slot_free)
        if placed:
            self.dispatched.extend(placed)

    def take_dispatched(self) -> list[Ticket]:
        """The requests placed from the queue since the last call, in placement order;
        each ticket's ``owner`` is its exchange, which sends when told
        (``Exchange.dispatched_from_queue``)."""
        out, self.dispatched = self.dispatched, []
        return out

    def take_measuring(self) -> list[Exchange]:
        """The exchanges waiting for their prompt to be measured since the last call."""
        out, self.measuring = self.measuring, []
        return out

    # -- commands: change who may take work, pump, notify -------------------------------
    def _command_done(self) -> None:
        self.pump()
        self.changed()

    def set_maintenance(self, engines: Iterable[EngineState], on: bool) -> None:
        for e in engines:
            e.maintenance = on
        self._command_done()

    def set_fenced(self, on: bool) -> None:
        self.fenced = on
        self._command_done()

    def start_draining(self) -> None:
        self.draining = True
        self._command_done()

    def round_done(self) -> None:
        """A telemetry round completed: the router has seen its engines, and one that
        came back can take queued work."""
        self.started = True
        self.heartbeat = self.clock()
        self._command_done()

    def profiled(self) -> None:
        """A profile ended (either way): eligibility may have changed."""
        self._command_done()
