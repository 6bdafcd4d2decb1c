"""The router's shared state: configuration, pool, accounting, serving state."""

from __future__ import annotations

from ..config import Config
from .accounting import Accounting
from .pool import Pool


class Router:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.pool = Pool(config.engines)
        self.accounting = Accounting()
        self.draining = False

    def not_ready_reason(self) -> str | None:
        """Why the router refuses to serve now, or None when it serves (DESIGN §6)."""
        if self.draining:
            return "draining"
        if self.config.router.role == "standby":
            return "standby"
        if not self.pool.checked:
            return "starting"
        return None
