"""The router's shared state: configuration, pool, accounting, serving state."""

from __future__ import annotations

from collections.abc import Callable

from ..config import Config
from .accounting import Accounting
from .pool import Pool


class Router:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.pool = Pool(config.engines)
        self.accounting = Accounting()
        self.draining = False
        self.listeners: list[Callable[[], None]] = []

    def changed(self) -> None:
        """Serving state may have changed (health round, drain): tell the listeners."""
        for listener in self.listeners:
            listener()

    def not_ready_reason(self) -> str | None:
        """Why the router refuses to serve now, or None when it serves (DESIGN §6)."""
        if self.draining:
            return "draining"
        if self.config.router.role == "standby":
            return "standby"
        if not self.pool.checked:
            return "starting"
        return None
