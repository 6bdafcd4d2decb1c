"""Doing the work the core returns: the one place where exchanges meet the event loop.

The core never sends, schedules or calls back into an exchange. After each step it
leaves two kinds of work: an exchange's ``wake_at`` (when its deadline, admission wait
or stall check is due) and the router's ``dispatched`` queue (requests the scheduler
placed from its queue, which belong to *other* exchanges). A ``Driver`` wraps one
exchange for a transport adapter: it sends the actions of each step, keeps the
exchange's timer in step with ``wake_at``, and then has the ``Runtime`` send what was
dispatched. The runtime also keeps the close-verdict timer and drains dispatches after
background commands (telemetry, admin, profiling), which notify the router's listeners.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from ..core.exchange import Action, Exchange
from ..core.record import ExchangeRecord
from ..core.router import Router

log = logging.getLogger("narwhal.driver")
Send = Callable[[list[Action]], None]


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """The event loop's ``call_later`` (tests pass a manual clock's)."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> TimerHandle: ...


class RecordSink(Protocol):
    def record(self, r: ExchangeRecord | None) -> None: ...


# Where finished exchanges' records go (tracing), when something wants them.
RECORDS: list[RecordSink] = []


class Alarm:
    """One timer kept on a wake-up time the core returned; re-armed only when it changes
    (checked after every step, so it must cost nothing when it does not)."""

    __slots__ = ("timers", "clock", "callback", "handle", "at")

    def __init__(self, timers: Timers, clock: Callable[[], float],
                 callback: Callable[[], None]) -> None:
        self.timers = timers
        self.clock = clock
        self.callback = callback
        self.handle: TimerHandle | None = None
        self.at: float | None = None

    def set(self, when: float | None) -> None:
        if when == self.at:
            return
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.at = when
        if when is not None:
            self.handle = self.timers.call_later(max(0.0, when - self.clock()), self._fire)

    def _fire(self) -> None:
        self.handle = None
        self.at = None
        self.callback()


class Runtime:
    """Per router: the live drivers (to find the exchange a dispatched ticket belongs
    to), the close-verdict timer, and draining the router's dispatches."""

    def __init__(self, router: Router, timers: Timers) -> None:
        self.router = router
        self.timers = timers
        self.live: dict[Exchange, Driver] = {}
        self.closes = Alarm(timers, router.clock, self._closes_due)
        router.listeners.append(self.drain)  # background commands pump, then notify

    def drain(self) -> None:
        """Send every request the scheduler placed since the last drain. Sending one can
        end it (an internal error), which frees a slot and places more: loop until none."""
        router = self.router
        while router.dispatched:
            for ticket in router.take_dispatched():
                driver = self.live.get(ticket.owner)
                if driver is None:  # its stream is gone; its release already settled it
                    continue
                driver.deliver(driver.ex.dispatched_from_queue())

    def sync_closes(self) -> None:
        """Keep one timer on the oldest wait for a close verdict."""
        self.closes.set(self.router.closes.wake_at())

    def _closes_due(self) -> None:
        self.router.closes.expire(self.router.clock())
        self.sync_closes()


class Driver:
    """One exchange, driven for a transport adapter. ``send`` writes the actions of a
    step in order; ``flush`` (optional) pushes writes made outside a message's turn."""

    __slots__ = ("runtime", "ex", "send", "flush", "alarm")

    def __init__(self, runtime: Runtime, send: Send,
                 flush: Callable[[], None] | None = None, ex: Exchange | None = None) -> None:
        """``ex``: an exchange taken over from another process (``core/handoff.py``);
        otherwise a new one."""
        self.runtime = runtime
        self.ex = Exchange(runtime.router) if ex is None else ex
        self.send = send
        self.flush = flush
        self.alarm = Alarm(runtime.timers, runtime.router.clock, self._due)
        runtime.live[self.ex] = self

    def step(self, call: Callable[..., list[Action]], *args: object) -> None:
        """Run one exchange method (one ext_proc message), send its actions, then the
        work it left: its timer, and requests it let the scheduler dispatch."""
        self.send(self._run(call, *args))
        self._sync_timer()
        if self.runtime.router.dispatched:  # per message: no call when there is none
            self.runtime.drain()

    def _run(self, call: Callable[..., list[Action]], *args: object) -> list[Action]:
        """An exchange method's actions; a bug in it ends this request alone (500)."""
        try:
            return call(*args)
        except Exception as exc:
            log.exception("exchange failed in %s", getattr(call, "__name__", call))
            return self.ex.internal_error(exc)

    def deliver(self, actions: list[Action]) -> None:
        """Actions outside this exchange's own messages (dispatch, expiry)."""
        if actions:
            self.send(actions)
            if self.flush is not None:
                self.flush()
        self._sync_timer()

    def closed(self) -> None:
        """The ext_proc stream is over: close the exchange, hand its record on (once),
        and do what its release left (slots freed, a verdict to wait for)."""
        if self.runtime.live.pop(self.ex, None) is None:
            return
        ex = self.ex
        ex.close()
        self._sync_timer()
        if RECORDS:
            rec = ex.record()
            if rec is not None:
                for sink in RECORDS:
                    try:
                        sink.record(rec)
                    except Exception:  # reporting must never harm serving
                        log.exception("exchange record sink failed")
        self.runtime.sync_closes()
        self.runtime.drain()

    def _sync_timer(self) -> None:
        self.alarm.set(self.ex.wake_at)

    def _due(self) -> None:
        self.deliver(self._run(self.ex.expire))
        self.runtime.drain()
