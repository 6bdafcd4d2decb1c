"""Telling an engine that failed from a client that left.

When either goes away mid-response, Envoy ends the ext_proc stream the same way, so
Narwhal alone cannot tell a client disconnect (``cancelled``) from an engine reset
(``failed``). Envoy can: its response flags say which side it was. Envoy's gRPC access
log (configured to send only the entries flagged with an upstream failure) reaches
Narwhal shortly after the stream ends; an exchange that ended ambiguously waits that
long for a verdict, its slots already freed, and counts ``cancelled`` if none comes.
Verdicts that arrive before their exchange closed are kept, in a bounded table.

No timers here: ``wake_at`` says when the oldest wait runs out and the adapter calls
``expire`` then (the core returns the work to do, it does not schedule it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .errors import CANCELLED


class CloseVerdicts:
    __slots__ = ("wait_s", "pending", "early", "capacity")

    def __init__(self, wait_s: float, capacity: int = 4096) -> None:
        self.wait_s = wait_s
        self.capacity = capacity
        # request id -> (when the wait ends, settle); in closing order, so in deadline order
        self.pending: OrderedDict[str, tuple[float, Callable[[str], None]]] = OrderedDict()
        self.early: OrderedDict[str, str] = OrderedDict()

    def closed(self, request_id: str, settle: Callable[[str], None], now: float) -> None:
        """An exchange ended without knowing why: ``settle(terminal)`` once it is known."""
        verdict = self.early.pop(request_id, None) if request_id else None
        if verdict is not None:
            settle(verdict)
        elif not request_id or self.wait_s <= 0 or request_id in self.pending:
            settle(CANCELLED)
        else:
            self.pending[request_id] = (now + self.wait_s, settle)

    def wake_at(self) -> float | None:
        """When the oldest wait for a verdict runs out (None: nothing waits)."""
        for deadline, _ in self.pending.values():
            return deadline
        return None

    def expire(self, now: float) -> None:
        """Waits that ran out count ``cancelled``: no verdict came."""
        while self.pending:
            request_id, (deadline, settle) = next(iter(self.pending.items()))
            if deadline > now:
                return
            del self.pending[request_id]
            settle(CANCELLED)

    def logged(self, request_id: str, verdict: str) -> None:
        """Envoy's access log says how ``request_id`` ended."""
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            entry[1](verdict)
            return
        self.early[request_id] = verdict
        self.early.move_to_end(request_id)
        while len(self.early) > self.capacity:
            self.early.popitem(last=False)
