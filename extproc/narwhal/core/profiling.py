"""Profiling measurement: an engine answers a few synthetic requests before it takes
traffic, when it joins, when it comes back from being unhealthy, and when its model
drifted.

Why: with its seeds at their defaults (a user does not know the engine's internals)
the performance model would admit the first requests against a guess. A profile is
five requests of chosen prompt sizes and a short output, each with token IDs asked
for; the measurements go into the same learning sink as live traffic, and the
engine is placement-eligible once all five succeeded. Like a decode attempt, a
profile fails on an event without a valid token-ID list (missing, Boolean, malformed):
an engine that cannot identify its output cannot be metered, so it stays ineligible
and is retried with backoff.

This module is pure: ``Profiler`` decides which engines are due and builds the probe
requests; ``ProbeRun`` turns timestamped stream chunks into a measurement. The adapter
(``server/profiling.py``) does the HTTP.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import orjson

from .engines import EngineState
from .meter import EngineOutputError, Meter
from .sse import SSEError, SSEParser
from .tokens import TokenIdError

PROBE_PROMPTS = (64, 256, 512, 1024, 1536)  # prompt tokens of the probes
PROBE_OUTPUT = 8
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_WORDS = ("profile probe engine token prefill decode measure narwhal ocean tusk").split()


@dataclass(frozen=True, slots=True)
class Probe:
    tokens: int  # intended prompt tokens
    body: bytes


@dataclass(slots=True)
class Measurement:
    prompt_tokens: int
    ttft_s: float
    intervals: list[float] = field(default_factory=list)  # seconds per output token


class ProbeRun:
    """One probe's response, fed as it arrives."""

    def __init__(self, started: float, token_ids: bool, max_event_bytes: int) -> None:
        self.started = started
        self.meter = Meter(chat=True, token_ids=token_ids)
        self.sse = SSEParser(max_event_bytes)
        self.first: float | None = None
        self.last: float | None = None
        self.intervals: list[float] = []
        self.done = False

    def feed(self, now: float, chunk: bytes) -> None:
        """Raises ``EngineOutputError`` (``TokenIdError`` included) on a bad event."""
        try:
            events = self.sse.feed(chunk)
        except SSEError as exc:
            raise EngineOutputError(str(exc)) from None
        for raw in events:
            if raw == b"[DONE]":
                self.done = True
                continue
            try:
                event = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise EngineOutputError(f"engine event is not JSON: {exc}") from None
            n = self.meter.observe(event, raw)
            if not n:
                continue
            if self.first is None:
                self.first = now
            elif self.last is not None:
                self.intervals.append((now - self.last) / n)
            self.last = now

    def finish(self, estimated_prompt: int) -> Measurement:
        if not self.done or self.first is None:
            raise EngineOutputError("engine ended the profile stream without output")
        if self.meter.output_tokens <= 0:
            raise TokenIdError("engine profile output carried no token IDs")
        prompt = self.meter.prompt_token_ids
        if prompt is None and self.meter.usage is not None:
            reported = self.meter.usage.get("prompt_tokens")
            prompt = reported if reported.__class__ is int and reported > 0 else None
        return Measurement(prompt or estimated_prompt, self.first - self.started, self.intervals)


class Profiler:
    def __init__(self, model: str, bytes_per_token: float, timeout_s: float,
                 rng: random.Random | None = None) -> None:
        self.model = model
        self.bytes_per_token = bytes_per_token
        self.timeout_s = timeout_s
        self.rng = rng or random.Random()

    def due(self, engines: list[EngineState], now: float) -> list[EngineState]:
        """Engines to profile now (marked running): healthy, not profiled, not already
        being profiled, past their backoff."""
        out = []
        for e in engines:
            if (e.healthy and not e.retired and not e.profiled and not e.profiling
                    and now >= e.profile_next_at):
                e.profiling = True
                out.append(e)
        return out

    def probes(self, max_model_len: int | None = None) -> list[Probe]:
        """Prompts that share no prefix with anything (a fresh nonce first), so the
        engine's prefix cache cannot make them look fast; at most a third of the engine's
        context (``max_model_len`` from its /v1/models), as sizing is an estimate."""
        out = []
        for size in PROBE_PROMPTS:
            tokens = min(size, max_model_len // 3) if max_model_len else size
            nonce = f"{self.rng.getrandbits(64):016x}"
            words: list[str] = [nonce]
            size = len(nonce)
            target = tokens * self.bytes_per_token
            while size < target:
                w = self.rng.choice(_WORDS)
                words.append(w)
                size += len(w) + 1
            body = {"model": self.model, "stream": True, "max_tokens": PROBE_OUTPUT,
                    "min_tokens": PROBE_OUTPUT, "temperature": 0, "return_token_ids": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": " ".join(words)}]}
            out.append(Probe(tokens, orjson.dumps(body)))
        return out

    def succeeded(self, e: EngineState, now: float) -> None:
        e.profiling = False
        e.profiled = True
        e.profile_error = None
        e.profile_attempts = 0
        e.profiled_at = now
        e.profiles += 1

    def failed(self, e: EngineState, reason: str, now: float) -> None:
        e.profiling = False
        e.profiled = False
        e.profile_error = reason
        e.profile_next_at = now + BACKOFF_S[min(e.profile_attempts, len(BACKOFF_S) - 1)]
        e.profile_attempts += 1
        e.profile_failures += 1


def reprofile(e: EngineState) -> None:
    """The engine must be measured again before it takes new work (it came back, or its
    model drifted)."""
    e.profiled = False
    e.profile_next_at = 0.0
    e.profile_attempts = 0
    # What its measurements had verified is history too: it takes work again from what
    # the new profile verifies, growing as first tokens catch up (verified-backlog).
    # Kept, a drifted a100 came back to 24 placements at once, projected at 7-9 s with its
    # fresh model and measured at 13-19 s.
    e.verified_work = 0.0
    e.calibration.clear()  # its ratios judged the model the engine had
    e.idle_calibration.clear()
