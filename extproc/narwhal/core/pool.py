"""The engine pool: membership (static or discovered), and which engines may take work.

Commands that change eligibility (maintenance, a health round, a profile) change
engine state here; whoever issues them then asks the router to notify and pump,
so that queued work moves as soon as an engine can take it.
"""

from __future__ import annotations

from ..config import Config, EngineConfig
from .engines import EngineState
from .prefix import PrefixIndex


class Pool:
    def __init__(self, config: Config) -> None:
        self.stale_after_s = config.telemetry.stale_after_ms / 1000
        self.profiling = config.telemetry.profiling
        self.drift_threshold = config.telemetry.drift_threshold
        self.prefix_blocks = config.scheduler.prefix_index_blocks
        self.engines: list[EngineState] = []
        for cfg in config.engines:
            self._add(cfg)

    def _add(self, cfg: EngineConfig) -> EngineState:
        e = EngineState.from_config(cfg)
        e.profiled = not self.profiling  # with profiling off, health alone admits it
        e.model.drift_limit = self.drift_threshold
        e.prefix = PrefixIndex(self.prefix_blocks)
        self.engines.append(e)
        return e

    def observe_kv_capacity(self, e: EngineState, tokens: float, tokens_per_block: float
                            ) -> None:
        """The engine's KV cache holds ``tokens`` tokens (its cache configuration): its
        prefix index remembers no more prompt than that cache can, within the configured
        bound, so entries expire about when the engine's own would."""
        e.kv_capacity_tokens = int(tokens)
        if self.prefix_blocks and tokens > 0:
            e.prefix.resize(max(1, min(self.prefix_blocks,
                                       int(tokens / max(1.0, tokens_per_block)))))

    def reconcile(self, wanted: dict[str, EngineConfig]) -> tuple[list[str], list[str]]:
        """Make the pool match ``wanted`` (endpoint -> config): add the new, retire the
        gone (no new work; dropped once their in-flight requests end). Returns the
        names added and retired."""
        have = {e.endpoint: e for e in self.engines}
        added, retired = [], []
        for endpoint, cfg in wanted.items():
            e = have.get(endpoint)
            if e is None:
                self._add(cfg)
                added.append(cfg.name)
            elif e.retired:
                e.retired = False  # came back before it drained
        for endpoint, e in have.items():
            if endpoint not in wanted and not e.retired:
                e.retired = True
                retired.append(e.name)
        self.sweep()
        return added, retired

    def sweep(self) -> None:
        self.engines[:] = [e for e in self.engines if not (e.retired and e.in_flight == 0)]

    def serviceable(self, now: float, candidates: frozenset[str] | None = None
                    ) -> list[EngineState]:
        return [e for e in self.engines if e.serviceable(now, self.stale_after_s)
                and (candidates is None or e.endpoint in candidates)]

    def _live(self) -> list[EngineState]:
        return [e for e in self.engines if not e.retired]

    def all_stale(self, now: float) -> bool:
        live = self._live()
        return bool(live) and not any(e.fresh(now, self.stale_after_s) for e in live)

    def all_unprofiled(self, now: float) -> bool:
        """Engines are up, and not one is profiled yet: nothing can take work."""
        up = [e for e in self._live() if e.healthy and e.fresh(now, self.stale_after_s)]
        return bool(up) and not any(e.profiled for e in up)

    def all_in_maintenance(self) -> bool:
        live = self._live()
        return bool(live) and all(e.maintenance for e in live)
