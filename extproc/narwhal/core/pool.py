"""The engine pool: membership (static or discovered), and which engines may take work.

Commands that change eligibility (maintenance, a health round, a profile) change
engine state here; whoever issues them then asks the router to notify and pump,
so that queued work moves as soon as an engine can take it. Health checks arrive as
``Scrape`` values: the telemetry adapter does the HTTP, the pool decides what it means.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, EngineConfig
from .calibration import Calibration
from .engines import EngineState
from .kv_events import KvBlocks, KvEventError, decode_batch
from .prefix import PrefixIndex
from .profiling import reprofile


@dataclass(frozen=True, slots=True)
class Scrape:
    """One health check of one engine, as the telemetry adapter saw it."""

    healthy: bool = False  # /health answered 200
    timed_out: bool = False  # a request of the check timed out
    unreachable: bool = False  # connection refused or reset
    metrics: dict[str, float] | None = None  # vLLM's series, when /metrics answered 200
    no_metrics: bool = False  # /metrics answered 404: a passing /health alone is fresh


KV_BLOCKS_DEFAULT = 65_536  # the reported-blocks bound when the prefix index is off


class Pool:
    def __init__(self, config: Config) -> None:
        self.stale_after_s = config.telemetry.stale_after_ms / 1000
        self.profiling = config.telemetry.profiling
        self.drift_threshold = config.telemetry.drift_threshold
        self.timeouts_limit = config.telemetry.unhealthy_after_timeouts
        self.kv_stale_s = config.telemetry.kv_events_stale_ms / 1000
        self.prefix_blocks = config.scheduler.prefix_index_blocks
        self.engines: list[EngineState] = []
        # Every engine's admission samples together: the margin of an engine that has
        # none of its own for a size of projection (calibration.py).
        self.calibration = Calibration()
        self.idle_calibration = Calibration()  # and of requests placed on idle engines
        for cfg in config.engines:
            self._add(cfg)

    def _add(self, cfg: EngineConfig) -> EngineState:
        e = EngineState.from_config(cfg)
        e.profiled = not self.profiling  # with profiling off, health alone admits it
        e.model.drift_limit = self.drift_threshold
        e.prefix = PrefixIndex(self.prefix_blocks)
        e.calibration.pool = self.calibration
        e.idle_calibration.pool = self.idle_calibration
        if cfg.kv_events:
            e.kv = KvBlocks(self.prefix_blocks or KV_BLOCKS_DEFAULT, self.kv_stale_s)
        self.engines.append(e)
        return e

    def observe_kv_events(self, e: EngineState, payload: bytes, now: float,
                          seq: int | None = None, replayed: bool = False) -> None:
        """A batch from the engine's KV-event publisher (``seq``: its sequence number;
        ``replayed``: from its replay buffer). One that cannot be read counts as an error
        and forgets what was held (what it said is unknown)."""
        if e.kv is None:
            return
        if seq is not None:
            e.kv.sequence(seq, replayed)
        try:
            events = decode_batch(payload)
        except KvEventError:
            e.kv.failed()
            raise
        e.kv.apply(events, now)

    def observe_kv_capacity(self, e: EngineState, tokens: float, tokens_per_block: float
                            ) -> None:
        """The engine's KV cache holds ``tokens`` tokens (its cache configuration): its
        prefix index remembers no more prompt than that cache can, within the configured
        bound, so entries expire about when the engine's own would."""
        e.kv_capacity_tokens = int(tokens)
        if self.prefix_blocks and tokens > 0:
            e.prefix.resize(max(1, min(self.prefix_blocks,
                                       int(tokens / max(1.0, tokens_per_block)))))

    def observe(self, e: EngineState, scrape: Scrape, now: float, tokens_per_block: float
                ) -> bool:
        """Apply one health check; True when the engine's health changed (or was first
        known). A timeout counts against the engine only after ``unhealthy_after_timeouts``
        in a row (a busy engine is slow, not down); an engine that comes back may have
        restarted, so its prefix index is cleared and, with profiling on, it is measured
        again before it takes work."""
        if scrape.timed_out:
            e.health_timeouts += 1
            ok, fresh = e.healthy and e.health_timeouts < self.timeouts_limit, False
        else:
            if not scrape.unreachable:
                e.health_timeouts = 0
            ok = scrape.healthy
            fresh = ok and (scrape.metrics is not None or scrape.no_metrics)
        values = scrape.metrics
        if ok and values:
            for attr in ("running", "waiting", "kv_cache_usage"):
                if attr in values:
                    setattr(e, attr, values[attr])
            e.model.step_model.engine_waiting(e.waiting)
            if "kv_capacity_tokens" in values:
                self.observe_kv_capacity(e, values["kv_capacity_tokens"], tokens_per_block)
            if "prefix_queries" in values and "prefix_hits" in values:
                e.model.observe_cache(values["prefix_queries"], values["prefix_hits"])
        changed = ok != e.healthy or not e.checked
        if changed and ok and e.checked:
            e.prefix.clear()  # it may have restarted: its prefix cache is gone
            if e.kv is not None:
                e.kv.restarted()
            if self.profiling:
                reprofile(e)
        e.healthy = ok
        e.checked = True
        if fresh:
            e.telemetry_at = now
        return changed

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

    def any_serviceable(self, now: float) -> bool:
        """One engine could take work: asked per request before the pool-wide reasons not
        to serve (each a walk of the pool), which an engine that could take work rules
        out, and usually the first one listed can."""
        stale = self.stale_after_s
        return any(e.serviceable(now, stale) for e in self.engines)

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
