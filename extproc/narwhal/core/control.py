"""What an exchange does to the shared state once it has been sent upstream.

After dispatch an exchange touches the router's shared state at a few points only: the
engine Envoy reports as the one that served, the first token (which frees the prefill
slot), the release (retention, the engine slot, what was learned from the output), the
terminal count, and an end that needs Envoy's verdict. They are the methods of
``Control``, which applies them to the router in this process.

Why a seam here: with ``serving.workers`` the response phase runs in a worker process
whose exchange has no router of its own to change; its ``Control`` sends the same calls
to the scheduler process (``server/workers.py``), which applies them, with this class, to
the exchange it admitted. Either way the decisions are made once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import errors

if TYPE_CHECKING:
    from .engines import EngineState
    from .exchange import Exchange
    from .router import Router


@dataclass(slots=True, frozen=True)
class Outcome:
    """What a request's end reports about its output (None: it never reached metering)."""

    output_tokens: int | None = None  # metered output tokens, any terminal
    prompt_tokens: int | None = None  # the engine's usage, when it completed with one
    last_token_at: float = 0.0
    token_id_fault: bool = False  # it failed on an event without valid token IDs
    reply: str | None = None  # its generated text, when it completed (the prefix index)


class Control:
    """The router's side of an exchange after dispatch, in this process."""

    __slots__ = ("router",)

    def __init__(self, router: Router) -> None:
        self.router = router

    def served_by(self, ex: Exchange, endpoint: str) -> EngineState | None:
        """Envoy connected to ``endpoint``: the engine the request moved to, or None."""
        if ex.ticket is None:
            return None
        moved = self.router.scheduler.served_by(ex.ticket, endpoint)
        if moved is not None:
            ex.engine = moved
        return moved

    def token(self, ex: Exchange, now: float, first: bool) -> None:
        """Output tokens of the request left its engine at ``now`` (``first``: its first,
        whose sequence decodes from that step on): they end one of the engine's steps,
        which its step model times."""
        e = ex.engine
        if e is not None:
            e.model.token(now, e.decode + (1 if first else 0))

    def first_token(self, ex: Exchange, now: float) -> None:
        """Its first output token: the prefill slot is free, the queue may move."""
        t = ex.ticket
        if t is not None and t.first_token_at is None:
            self.router.scheduler.first_token(t, now)
            self.router.pump()

    def release(self, ex: Exchange, terminal: str, out: Outcome) -> None:
        """Give back what the request holds (retention, its engine slot) and learn from
        its output."""
        router = self.router
        if ex.held:
            ex.held = False
            router.held -= 1
        e = ex.engine
        identified: int | None = None
        if e is not None:
            if out.token_id_fault:
                e.measurement_failures += 1
            if out.output_tokens is not None:
                e.output_tokens += out.output_tokens
                if terminal == errors.COMPLETED:
                    identified = out.output_tokens
                    e.completed += 1
                    if out.prompt_tokens is not None and ex.request is not None:
                        router.sizer.learn(ex.request.prompt_bytes, out.prompt_tokens)
        if ex.ticket is not None:
            router.scheduler.release(ex.ticket, identified, out.last_token_at, out.reply)
            router.pump(if_slot_free=True)  # its freed decode slot is rarely the one missing

    def count(self, ex: Exchange, terminal: str) -> None:
        """The request's one terminal class (possibly some time after its release)."""
        acct = self.router.accounting
        acct.end(terminal)
        if not ex.sized:
            acct.unsized_offered += 1

    def closed(self, ex: Exchange, now: float) -> None:
        """It ended mid-response without knowing why: count it once Envoy's access log
        says which side went away (``closes.py``)."""

        def settle(terminal: str) -> None:
            ex.terminal = terminal
            self.count(ex, terminal)

        self.router.closes.closed(ex.request_id, settle, now)
