"""Per-engine state: health, telemetry freshness, maintenance, phase slots, the prefill
work Narwhal has dispatched to it, and its performance model (``perf.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import EngineConfig
from ..config import Scheduler as SchedulerConfig
from .calibration import Calibration
from .kv_events import KvBlocks
from .perf import PerfModel
from .prediction_error import ErrorWindow
from .prefix import PrefixIndex

TOKEN_ID_DIALECTS = frozenset({"vllm"})
ENGINE_ERROR_WINDOW = 512  # an engine's recent TTFT prediction errors (/status, /metrics)


@dataclass(slots=True)
class EngineState:
    config: EngineConfig
    model: PerfModel
    healthy: bool = False
    checked: bool = False
    health_timeouts: int = 0  # consecutive timed-out health checks
    telemetry_at: float | None = None  # monotonic time of the last good /metrics scrape
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    maintenance: bool = False
    retired: bool = False  # gone from discovery: drained, then dropped
    prefill: int = 0
    decode: int = 0
    # Uncached prompt tokens of the requests in prefill here: the work ahead of the next.
    prefill_work: float = 0.0
    # The most prefill work (own and ahead) at whose dispatch a first token has been
    # measured here: how far the model's projections for this engine have been checked
    # (the verified-backlog filter).
    verified_work: float = 0.0
    # Predicted output tokens of the requests placed here (output-length learning).
    decode_backlog: int = 0
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(0))
    # The blocks the engine reports holding (engines[].kv_events); None without events.
    kv: KvBlocks | None = None
    predicted_hit_rate: float = 0.0  # recent share of dispatched prompts found in ``prefix``
    # Cumulative prompt tokens dispatched here and the part the index expected cached:
    # over any window, comparable with the engine's own prefix-cache counters.
    index_tokens: float = 0.0
    index_cached_tokens: float = 0.0
    # Admission margin for this engine: recent measured/predicted TTFT ratios by size of
    # the projection (calibration.py). Per engine: one engine's model error must not
    # widen every margin.
    calibration: Calibration = field(default_factory=Calibration)
    # The same for requests placed while the engine was ``idle``: nothing ahead of them
    # there, no step under way, so what their projections miss is of another kind, and
    # an idle engine judged by its loaded margin turned work away with nothing to serve
    # (two real vLLMs sharing two cores: margins of 2-8x from busy moments and few
    # samples refused 0.5-1 s projections on an idle engine, which, sent nothing, learned
    # nothing new; docs/measurements.md, "Forty-third session").
    idle_calibration: Calibration = field(default_factory=Calibration)
    # How far the TTFT predicted for requests placed here ran from what was measured.
    prediction_errors: ErrorWindow = field(
        default_factory=lambda: ErrorWindow(ENGINE_ERROR_WINDOW))
    completed: int = 0
    output_tokens: int = 0
    measurement_failures: int = 0
    dispatched: int = 0
    kv_capacity_tokens: int = 0  # the engine's KV cache size (vllm:cache_config_info)
    failovers: int = 0  # placed here, served by a fallback (this engine did not answer)
    endpoint: str = ""  # ``ip:port`` for Envoy, computed once
    # Profiling (profiling.py): eligible only once measured.
    profiled: bool = False
    profiling: bool = False
    profile_next_at: float = 0.0
    profile_error: str | None = None
    profile_attempts: int = 0  # failures in a row (backoff)
    profile_failures: int = 0
    profiles: int = 0  # profiles completed
    profiled_at: float | None = None

    def __post_init__(self) -> None:
        self.endpoint = self.config.endpoint

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineState:
        return cls(config, PerfModel(config.prefill_tps, config.tpot_ms, config.overhead_ms))

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def token_ids(self) -> bool:
        return self.config.dialect in TOKEN_ID_DIALECTS

    @property
    def token_accounting(self) -> str:
        return "token_ids" if self.token_ids else "unavailable"

    @property
    def in_flight(self) -> int:
        return self.prefill + self.decode

    def idle(self) -> bool:
        """Nothing in flight here: by Narwhal's books, and by the engine's last report
        (another client's requests count; a report lags by up to a scrape)."""
        return not (self.prefill or self.decode or self.running or self.waiting)

    def margins(self, idle: bool) -> Calibration:
        """The admission margins for a request placed here now (``idle``: on an idle
        engine)."""
        return self.idle_calibration if idle else self.calibration

    def prompt_sent(self, tokens: float, cached: float) -> None:
        """A prompt of ``tokens`` went to the engine, the share ``cached`` of it expected
        in its prefix cache. Every prompt counts, profile probes too (nothing of theirs
        is cached: a fresh nonce first), as the engine's own prefix-cache counters count
        every prompt: otherwise an engine profiled within a window runs its hit rate
        below the predicted one by the probes' share (~3.4k tokens a profile: 10 points
        on a lightly used engine in the scheduling benchmark)."""
        self.predicted_hit_rate += 0.05 * (cached - self.predicted_hit_rate)
        self.index_tokens += tokens
        self.index_cached_tokens += tokens * cached

    def fresh(self, now: float, stale_after_s: float) -> bool:
        return self.telemetry_at is not None and now - self.telemetry_at <= stale_after_s

    def serviceable(self, now: float, stale_after_s: float) -> bool:
        """Could take work at all: healthy, profiled, telemetry fresh, not in maintenance."""
        return (self.healthy and self.profiled and not self.maintenance and not self.retired
                and self.fresh(now, stale_after_s))

    def has_slot(self, cfg: SchedulerConfig, work: float = 0.0) -> bool:
        """Room for a request with ``work`` uncached prompt tokens: a prefill slot, a decode
        slot booked now (a request in prefill will need one), and its prompt within the
        prefill token bound unless nothing prefills here (a prompt over the bound must
        still go somewhere)."""
        bound = cfg.max_prefill_tokens_per_engine
        return (self.prefill < cfg.max_prefill_per_engine
                and self.prefill + self.decode < cfg.max_decode_per_engine
                and (not bound or not self.prefill or self.prefill_work + work <= bound))
