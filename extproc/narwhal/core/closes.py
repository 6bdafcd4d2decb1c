"""Telling an engine that failed from a client that left.

When either goes away mid-response, Envoy ends the ext_proc stream the same way, so
Narwhal alone cannot tell a client disconnect (``cancelled``) from an engine reset
(``failed``). Envoy can: its response flags say which side it was. Envoy's gRPC access
log (configured to send only the entries flagged with an upstream failure) reaches
Narwhal shortly after the stream ends; an exchange that ended ambiguously waits that
long for a verdict, its slots already freed, and counts ``cancelled`` if none comes.
Verdicts that arrive before their exchange closed are kept, in a bounded table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import CANCELLED

if TYPE_CHECKING:
    from .router import Timers


class CloseVerdicts:
    __slots__ = ("wait_s", "timers", "pending", "early", "capacity")

    def __init__(self, wait_s: float, timers: Timers, capacity: int = 4096) -> None:
        self.wait_s = wait_s
        self.timers = timers
        self.capacity = capacity
        self.pending: dict[str, Callable[[str], None]] = {}
        self.early: OrderedDict[str, str] = OrderedDict()

    def closed(self, request_id: str, settle: Callable[[str], None]) -> None:
        """An exchange ended without knowing why: ``settle(terminal)`` once it is known."""
        verdict = self.early.pop(request_id, None) if request_id else None
        if verdict is not None:
            settle(verdict)
        elif not request_id or self.wait_s <= 0 or request_id in self.pending:
            settle(CANCELLED)
        else:
            self.pending[request_id] = settle
            self.timers.call_later(self.wait_s, lambda: self._expire(request_id))

    def _expire(self, request_id: str) -> None:
        settle = self.pending.pop(request_id, None)
        if settle is not None:
            settle(CANCELLED)

    def logged(self, request_id: str, verdict: str) -> None:
        """Envoy's access log says how ``request_id`` ended."""
        settle = self.pending.pop(request_id, None)
        if settle is not None:
            settle(verdict)
            return
        self.early[request_id] = verdict
        self.early.move_to_end(request_id)
        while len(self.early) > self.capacity:
            self.early.popitem(last=False)
