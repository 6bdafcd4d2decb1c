"""Doing the work the core returns: the one place where exchanges meet the event loop.

The core never sends, schedules or calls back into an exchange. After each step it
leaves three kinds of work: an exchange's ``wake_at`` (when its deadline, admission wait
or stall check is due), the router's ``dispatched`` queue (requests the scheduler
placed from its queue, which belong to *other* exchanges) and its ``measuring`` list (a
long prompt to tokenize, which the ``Runtime`` does in a thread, ``Offload``, so that
the event loop serves every other stream meanwhile). A ``Driver`` wraps one
exchange for a transport adapter: it sends the actions of each step, keeps the
exchange's timer in step with ``wake_at``, and then has the ``Runtime`` send what was
dispatched. The runtime also keeps the close-verdict timer and drains dispatches after
background commands (telemetry, admin, profiling), which notify the router's listeners.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ..core.exchange import Action, Exchange, Measured
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

# Runs ``work`` somewhere, then ``done(result)`` on the event loop, ``result`` a callable
# that returns what ``work`` returned or raises what it raised.
Offload = Callable[[Callable[[], Any], Callable[[Callable[[], Any]], None]], None]


def inline(work: Callable[[], Any], done: Callable[[Callable[[], Any]], None]) -> None:
    """No thread: ``work`` runs when ``done`` asks (tests, and no event loop)."""
    done(work)


def in_thread(loop: Any) -> Offload:
    """``work`` on one thread of its own, ``done`` back on ``loop``. One: tokenizing is CPU
    work, and a second thread would only take turns with it."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="narwhal-measure")

    def offload(work: Callable[[], Any], done: Callable[[Callable[[], Any]], None]) -> None:
        loop.run_in_executor(pool, work).add_done_callback(lambda f: done(f.result))

    return offload


def _nothing() -> None:
    """A closed driver's timer callback."""


def _discard(actions: list[Action]) -> None:
    """A closed driver's ``send``: its stream is over."""


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

    def __init__(self, router: Router, timers: Timers, offload: Offload = inline) -> None:
        self.router = router
        self.timers = timers
        self.offload = offload
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

    def measure(self) -> None:
        """Tokenize each waiting exchange's long prompt off the event loop (``offload``);
        its admission goes on when that is done (``Driver.measured``)."""
        for ex in self.router.take_measuring():
            driver = self.live.get(ex)
            if driver is not None:
                self.offload(ex.measure, driver.measured)

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
        router = self.runtime.router
        if router.dispatched:  # per message: no call when there is none
            self.runtime.drain()
        if router.measuring:
            self.runtime.measure()

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

    def measured(self, result: Callable[[], Measured]) -> None:
        """The exchange's prompt, measured off the event loop (``result`` returns it, or
        raises what measuring raised: a failure ends this request alone)."""
        self.deliver(self._run(lambda: self.ex.measured(result())))
        self.runtime.drain()

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
        self._let_go()

    def _let_go(self) -> None:
        """Drop the references that make a closed request a cycle (this driver and its
        timer's callback, its adapter's send, the exchange and its ticket's owner), so
        that it is freed when its last holder lets go. Kept, each cycle waited for the
        cyclic collector: ~40 objects a request, whose collections cost 16-20 us a request
        in process. What runs for a closed exchange later (a prompt measured after its
        client left) sends nothing and arms nothing, as before."""
        self.alarm.callback = _nothing
        self.send = _discard
        if self.ex.ticket is not None:
            self.ex.ticket.owner = None

    def _sync_timer(self) -> None:
        self.alarm.set(self.ex.wake_at)

    def _due(self) -> None:
        self.deliver(self._run(self.ex.expire))
        self.runtime.drain()
