"""Per-engine state: health, telemetry freshness, maintenance, phase slots, and the
performance model that predicts time to first token.

Model v1 treats an engine's prefill as one FIFO server of ``prefill_tps`` tokens/s
(what chunked prefill on one GPU approximates): Narwhal keeps the engine's virtual
"prefill busy until" time, so a projection is the remaining prefill work already
dispatched plus the request's own, plus a fixed overhead. Measured first tokens
correct both the busy-until clock (drift) and the rate (EWMA).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig

TOKEN_ID_DIALECTS = frozenset({"vllm"})
EWMA = 0.3


@dataclass(slots=True)
class PerfModel:
    prefill_tps: float
    tpot_ms: float
    overhead_ms: float
    busy_until: float = 0.0  # monotonic seconds when dispatched prefill work ends
    samples: int = 0

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tps

    def projected_ttft_s(self, now: float, tokens: int, extra_tokens: float = 0.0) -> float:
        """TTFT if ``tokens`` were dispatched now, behind ``extra_tokens`` more work."""
        backlog = max(0.0, self.busy_until - now)
        return backlog + (tokens + extra_tokens) / self.prefill_tps + self.overhead_ms / 1000

    def dispatch(self, now: float, tokens: int) -> float:
        """Book the work; return the predicted first-token time (monotonic seconds)."""
        start = max(now, self.busy_until)
        self.busy_until = start + self.prefill_s(tokens)
        return self.busy_until + self.overhead_ms / 1000

    def first_token(self, now: float, predicted_at: float, service_s: float,
                    tokens: int, still_prefilling: bool, serialized: bool = False) -> None:
        """Correct the model from one measured first token."""
        if still_prefilling:
            self.busy_until = max(now, self.busy_until + (now - predicted_at))
        else:
            self.busy_until = now
        if tokens >= 16:  # tiny prompts measure overhead, not rate
            # Behind another prefill, the gap between first tokens is pure prefill work;
            # from idle it also holds the fixed overhead.
            work = service_s - (0.0 if serialized else self.overhead_ms / 1000)
            if work > 1e-4:
                rate = tokens / work
                self.prefill_tps += EWMA * (rate - self.prefill_tps)
                self.samples += 1

    def token_interval(self, ms: float) -> None:
        self.tpot_ms += EWMA * (ms - self.tpot_ms)


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
    last_first_token: float = 0.0
    completed: int = 0
    output_tokens: int = 0
    measurement_failures: int = 0
    dispatched: int = 0
    endpoint: str = ""  # ``ip:port`` for Envoy, computed once

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

    def fresh(self, now: float, stale_after_s: float) -> bool:
        return self.telemetry_at is not None and now - self.telemetry_at <= stale_after_s

    def serviceable(self, now: float, stale_after_s: float) -> bool:
        """Could take work at all: healthy, telemetry fresh, not in maintenance."""
        return (self.healthy and not self.maintenance and not self.retired
                and self.fresh(now, stale_after_s))

    def has_slot(self, max_prefill: int, max_decode: int) -> bool:
        # A request in prefill will need a decode slot: book it now.
        return self.prefill < max_prefill and self.prefill + self.decode < max_decode
