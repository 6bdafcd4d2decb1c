"""What one completion exchange did, as plain data, once it is over: the timeline
(monotonic seconds), the decisions and the counts. Adapters that report on requests
(tracing) read this record instead of the exchange's state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExchangeRecord:
    request_id: str
    chat: bool
    model: str
    stream: bool
    max_tokens: int | None
    terminal: str  # the terminal class so far (a mid-response close may be re-judged)
    status: int  # the engine's HTTP status (0: none), or the refusal's
    error_code: str | None  # Narwhal's refusal or failure code, if any
    arrival: float  # request headers
    decided_at: float | None  # admission decided (dispatch, queue or refusal)
    queued: bool
    dispatched_at: float | None
    first_token_at: float | None
    ended_at: float
    engine: str | None  # the engine that served (after any failover)
    endpoint: str | None
    fallbacks: tuple[str, ...]
    failover: bool
    predicted_ttft_s: float | None
    budget_s: float
    prompt_tokens: int | None  # the engine's count if it sent usage, else Narwhal's estimate
    output_tokens: int | None
    # W3C trace context the client (or Envoy) sent: traceparent, tracestate.
    trace_headers: tuple[tuple[str, str], ...]
    priority: int = 0  # its objective's (the router's objectives)
    flow: str = ""  # its fairness ID (admission.fairness round-robin)
