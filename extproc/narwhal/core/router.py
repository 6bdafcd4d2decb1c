"""The router's shared state: configuration, scheduler, accounting, serving state."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from ..config import Config
from .accounting import Accounting
from .closes import CloseVerdicts
from .engines import EngineState
from .leadership import Leadership
from .learning import Learning
from .pool import Pool
from .scheduler import Scheduler, Ticket
from .sizing import Sizer


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    def call_later(self, delay: float, callback: Callable[[], None]) -> TimerHandle: ...


class _NoTimer:
    def cancel(self) -> None:
        pass


class NoTimers:
    """For pure tests that never let time pass: timers are accepted and never fire."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> TimerHandle:
        return _NoTimer()


def default_identity() -> str:
    """A leader-election identity unique to this process: a restarted replica must not
    inherit its predecessor's lease (client-go's hostname + random suffix)."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class Router:
    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic,
                 timers: Timers | None = None, wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.wall = wall  # only for what is logged for other processes to compare
        self.timers: Timers = timers or NoTimers()
        self.pool = Pool(config)
        self.learning = Learning(self.pool)
        self.scheduler = Scheduler(config, self.pool, self.learning)
        self.sizer = Sizer(config.sizing.bytes_per_token, config.sizing.tokenizer)
        self.scheduler.tokenizer = self.sizer.tokenizer  # prefix blocks in tokens, if any
        self.accounting = Accounting()
        self.held = 0  # requests inside the HTTP retention limit
        self.draining = False
        self.fenced = False
        self.started = False  # the first telemetry round has completed
        self.heartbeat: float | None = None  # when the last telemetry round completed
        self.listeners: list[Callable[[], None]] = []
        self.closes = CloseVerdicts(config.telemetry.close_verdict_ms / 1000, self.timers)
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

    def wake(self, tickets: list[Ticket]) -> None:
        """Tickets the scheduler dispatched from the queue: their exchanges send now."""
        for t in tickets:
            owner: Any = t.owner
            owner.dispatched_from_queue()

    def pump(self) -> None:
        self.wake(self.scheduler.pump(self.clock()))
