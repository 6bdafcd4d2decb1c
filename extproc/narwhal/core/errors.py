"""The OpenAI error envelope and every refusal Narwhal can answer with.

Each error carries its terminal accounting class, so the place that decides to
refuse is also the place that decides how the refusal is counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson

# Terminal classes. Every offered request ends in exactly one.
COMPLETED = "completed"
INVALID = "invalid_requests"
REJECTED = "rejected"
REFUSED = "refused"
EXPIRED = "expired"
UNAVAILABLE = "unavailable"
FAILED = "failed"
CANCELLED = "cancelled"
TERMINAL_CLASSES = (COMPLETED, INVALID, REJECTED, REFUSED, EXPIRED, UNAVAILABLE, FAILED, CANCELLED)


@dataclass(frozen=True, slots=True)
class HttpError(Exception):
    status: int
    message: str
    type: str
    terminal: str
    code: str | int | None = None  # vLLM's envelopes carry the HTTP status as an int
    param: str | None = None
    retry_after: int | None = None  # Retry-After: whole seconds, as the seed's table says
    # The same hint without the rounding (``retry-after-ms``; else ``retry_after`` in ms),
    # which the official OpenAI clients read before Retry-After: see ``_return_ms``.
    retry_after_ms: int | None = None
    # ``x-should-retry`` (the OpenAI clients obey it before the status): False where the
    # same request cannot succeed later, which those clients would otherwise retry twice.
    should_retry: bool | None = None

    def body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.type, "param": self.param,
                       "code": self.code}}
        )

    def headers(self) -> list[tuple[str, str]]:
        hdrs = [("content-type", "application/json")]
        if self.retry_after is not None:
            ms = self.retry_after * 1000 if self.retry_after_ms is None else self.retry_after_ms
            hdrs += (("retry-after", str(self.retry_after)), ("retry-after-ms", str(ms)))
        if self.should_retry is not None:
            hdrs.append(("x-should-retry", "true" if self.should_retry else "false"))
        return hdrs

    def sse_event(self) -> bytes:
        """The same error as a terminal SSE event, for streams whose headers are sent."""
        return b"data: " + self.body() + b"\n\n"


def invalid_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", INVALID, param=param)


def model_not_found(model: str) -> HttpError:
    return HttpError(404, f"The model `{model}` does not exist.", "invalid_request_error", INVALID,
                     code="model_not_found", param="model")


def sampling_width(param: str, value: int) -> HttpError:
    return HttpError(400, f"Invalid sampling width: {param}={value}; Narwhal serves one choice per "
                     "request", "invalid_request_error", INVALID, param=param)


def request_too_large(limit: int) -> HttpError:
    return HttpError(413, f"Request body exceeds serving.max_request_bytes ({limit} bytes)",
                     "invalid_request_error", INVALID, code="request_too_large")


def request_body_fragmented(pieces: int, free: int, min_bytes: int) -> HttpError:
    return HttpError(400, f"Request body arrived in {pieces} pieces, too small: past {free} "
                     f"pieces each must bring {min_bytes} bytes on average; send it in fewer, "
                     "larger writes", "invalid_request_error", INVALID,
                     code="request_body_fragmented")


def retention_full() -> HttpError:
    return HttpError(429, "Too many requests in flight (HTTP retention limit); retry",
                     "rate_limit_error", REJECTED, code="retention_full", retry_after=1)


def held_bytes_full(limit: int, response: bool = False) -> HttpError:
    """One process's requests hold ``serving.max_held_bytes``: a new body is a capacity
    rejection (429); an assembly that would pass it ends its request (503)."""
    what = ("the router cannot hold this response" if response
            else "the router holds as many request and response bytes as it may")
    msg = f"{what} (serving.max_held_bytes: {limit}); retry"
    if response:
        return HttpError(503, msg, "server_error", FAILED, code="held_bytes_full",
                         retry_after=1)
    return HttpError(429, msg, "rate_limit_error", REJECTED, code="held_bytes_full",
                     retry_after=1)


def prompt_too_long(alone_s: float, budget_s: float) -> HttpError:
    return HttpError(
        429, f"The prompt alone needs about {alone_s * 1000:.0f} ms to prefill, over the "
        f"{budget_s * 1000:.0f} ms time-to-first-token budget: shorten the prompt or raise "
        "the target (x-slo-ttft-ms)", "rate_limit_error", REFUSED,
        code="prompt_exceeds_ttft_budget", should_retry=False)


def engines_saturated() -> HttpError:
    return HttpError(
        429, "Every engine's KV cache is full (scheduler.kv_usage_limit): no time to first "
        "token can be promised; retry later", "rate_limit_error", REFUSED,
        code="engines_saturated", retry_after=1)


def tpot_over_budget(projected_s: float, budget_s: float) -> HttpError:
    return HttpError(
        429, f"No engine can meet the {budget_s * 1000:.0f} ms time per output token budget "
        f"(best projection {projected_s * 1000:.1f} ms); retry later",
        "rate_limit_error", REFUSED, code="tpot_budget_exceeded", retry_after=1)


def _return_ms(overrun_s: float) -> int:
    """When to come back, in milliseconds: the overrun rounded up, at least the second
    Retry-After is at least. Why not the overrun alone: it is the earliest the request
    could fit, were nothing admitted meanwhile, and under load something always is.
    Measured in front of real vLLM (``bench.vllm_retries``, clients retrying as the
    OpenAI client does, 1.0-1.5x its capacity): returning after the raw overrun (median
    139-214 ms), 30-43% of retries were admitted and 51-67% of refused requests were
    served in the end; after the whole second, 32-70% and 54-91% (the same cells, the
    forty-fourth session's in docs/measurements.md). Why not Retry-After alone: rounded to the
    nearest second, an overrun of 1.4 s says 1 s, before the request could fit."""
    return max(1000, math.ceil(overrun_s * 1000))


def projected_over_budget(projected_s: float, budget_s: float,
                          waited_s: float | None = None) -> HttpError:
    """``waited_s``: the request was admitted into the queue and is given up after that
    wait (part of ``projected_s``); the message says so, as the client could not tell a
    refusal on arrival from one after a wait otherwise."""
    overrun = projected_s - budget_s
    queued = (f" after {waited_s * 1000:.0f} ms in the admission queue"
              if waited_s is not None else "")
    return HttpError(
        429, f"Projected time to first token {projected_s * 1000:.0f} ms exceeds the "
        f"{budget_s * 1000:.0f} ms budget by {overrun * 1000:.0f} ms{queued}; retry later",
        "rate_limit_error", REFUSED, code="ttft_budget_exceeded",
        retry_after=max(1, round(overrun)), retry_after_ms=_return_ms(overrun))


def queue_wait_over_limit(wait_s: float, limit_s: float) -> HttpError:
    overrun = wait_s - limit_s
    return HttpError(
        429, f"Projected wait in the admission queue {wait_s * 1000:.0f} ms exceeds the "
        f"{limit_s * 1000:.0f} ms limit (admission.max_wait_ms) by {overrun * 1000:.0f} ms; "
        "retry later", "rate_limit_error", REFUSED, code="queue_wait_exceeded",
        retry_after=max(1, round(overrun)), retry_after_ms=_return_ms(overrun))


def request_shed(priority: int) -> HttpError:
    return HttpError(
        429, f"No engine can take the request now and its objective is sheddable (priority "
        f"{priority}): it is not queued; retry later", "rate_limit_error", REJECTED,
        code="request_shed", retry_after=1)


def queue_full() -> HttpError:
    return HttpError(429, "Admission queue is full; retry", "rate_limit_error", REJECTED,
                     code="queue_full", retry_after=1)


def terminal_expiry(why: str) -> HttpError:
    return HttpError(504, f"Terminal expiry: {why} before response headers", "timeout_error",
                     EXPIRED, code="terminal_expiry")


def request_body_timeout(limit_ms: int) -> HttpError:
    return HttpError(408, f"The request body did not arrive within "
                          f"serving.request_body_timeout_ms ({limit_ms} ms)",
                     "timeout_error", EXPIRED, code="request_body_timeout")


def backend_unavailable() -> HttpError:
    return HttpError(503, "No placement-eligible engine is available", "service_unavailable",
                     UNAVAILABLE, code="backend_unavailable", retry_after=1)


def not_serving(reason: str) -> HttpError:
    return HttpError(503, f"Router is not serving ({reason}); retry", "service_unavailable",
                     UNAVAILABLE, code=reason.replace("-", "_"), retry_after=1)


def engine_failure(message: str) -> HttpError:
    return HttpError(502, message, "upstream_error", FAILED, code="bad_engine_response")


def engine_stalled(stall_ms: int) -> HttpError:
    return HttpError(504, f"the engine sent nothing for {stall_ms} ms "
                          "(serving.engine_stall_timeout_ms)", "upstream_error", FAILED,
                     code="engine_stalled")


def engine_refusal(status: int, error: object) -> HttpError:
    """The engine's own error envelope, as it answered before generating anything."""
    err = error if isinstance(error, dict) else {"message": str(error)}
    message = err.get("message")
    kind = err.get("type")
    param = err.get("param")
    code = err.get("code")
    return HttpError(status, message if isinstance(message, str) else "engine error",
                     kind if isinstance(kind, str) else "upstream_error",
                     INVALID if status < 500 else FAILED,
                     code=code if isinstance(code, str | int) and not isinstance(code, bool) else None,
                     param=param if isinstance(param, str) else None)


def not_found(path: str) -> HttpError:
    return HttpError(404, f"No route for {path}", "invalid_request_error", INVALID,
                     code="not_found")
