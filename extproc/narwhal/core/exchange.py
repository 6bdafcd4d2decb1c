"""One HTTP exchange as ext_proc sees it: an explicit state machine, free of I/O.

The gRPC adapter calls one method per ext_proc message and sends back the actions
returned, in order. The exchange owns the request from its arrival to exactly one
terminal class. It schedules nothing: ``wake_at`` says when it wants ``expire`` called,
and a queued request the scheduler placed is sent when the adapter calls
``dispatched_from_queue`` (it finds such requests in ``Router.take_dispatched``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from enum import Enum, auto

import orjson

from . import errors, pieces
from .assembly import Assembler
from .control import Outcome
from .engines import EngineState
from .errors import HttpError
from .meter import EngineErrorEvent, EngineOutputError, Meter
from .prefix import ReplyText
from .record import ExchangeRecord
from .relay import DONE, Relay
from .request import COMPLETION_PATHS, CompletionRequest, parse_request, upstream_body
from .router import Router
from .scheduler import Dispatch, PromptFacts, Queued, Refuse, Ticket
from .sse import SSEError, SSEParser
from .tokens import TokenIdError

log = logging.getLogger("narwhal.exchange")
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SLO_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"  # llm-d's name
PREDICTED_OUTPUT_HEADER = "x-narwhal-predicted-output-tokens"
PREDICTED_CACHED_HEADER = "x-narwhal-predicted-cached-tokens"  # of the prompt, on its engine
TIMEOUT_HEADER = "x-request-timeout-ms"
# An InferenceObjective's name (the Inference Extension's header, and llm-d's): its
# priority is the router's objectives' (admission.objectives, under the pool's
# InferenceObjectives where discovery follows them).
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
# A request's flow, which admission.fairness: round-robin gives its turn (the Extension's
# header, and llm-d's); bounded, as the queue keeps it.
FAIRNESS_HEADERS = ("x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id")
MAX_FLOW_BYTES = 256
PREDICTED_HEADER = "x-narwhal-predicted-ttft-ms"
# The Inference Extension conformance suite's test picker: a header naming the allowed
# endpoints, and the served endpoint echoed back (router.conformance_hooks only).
CONFORMANCE_SELECTION = "test-epp-endpoint-selection"
CONFORMANCE_SERVED = "x-conformance-test-served-endpoint"
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, continued by tracing
MAX_BODY_CHUNK = 62_000  # Envoy's streamed body mutations, as the Inference Extension sends them
# A request body larger than this is not held parsed while its request waits in the queue
# (the client's bytes are, parsed again at dispatch): parsed, a body takes up to ten times
# its bytes, and up to admission.queue_limit requests wait. A smaller one stays parsed:
# under ~160 KiB parsed, and no second parse, counted so against serving.max_held_bytes
# (``PARSED_HELD``; parked when that does not fit). Once sent upstream, no body is held
# parsed: up to admission.retention_limit requests are in flight, 160 MiB at 16 KiB each.
PARK_BYTES = 16_384
PARSED_HELD = 10  # a parsed body takes up to ten times its bytes (1 MiB of small messages: 9.8)
# Client paths that exist besides the completion routes, passed to an engine as they are.
PASSTHROUGH = frozenset({("GET", "/v1/models")})
# Request headers that steer routing or Narwhal: never taken from a client.
STEERING_PREFIXES = ("x-gateway-destination-endpoint", "x-narwhal-")
# Request headers that steer engines (the simulator's fault injection): forwarded only
# with serving.forward_control_headers (tests, demos).
CONTROL_PREFIXES = ("x-sim-",)
TIMER_SLACK = 0.002  # event-loop timers may fire up to a millisecond early
# A request body may arrive in up to BODY_PIECES_FREE pieces of any size; each piece past
# them must bring MIN_PIECE_BYTES of the body. Why: Envoy turns each piece (an HTTP/2 DATA
# frame, an HTTP/1 read) into an ext_proc message of its own, ~3 us here and ~2 us in
# Envoy, so a body of 1 MiB sent in 1-byte frames cost 3 s of this process's CPU, where
# the same body in 16 KB frames is ~64 messages. A client writing its body 64 bytes or
# more at a time is within the bound; under it, a 1 MiB body is at most ~17,400 messages.
BODY_PIECES_FREE = 1024
MIN_PIECE_BYTES = 64
# The same for an engine's answer (an HTTP/1 read of its body each): an engine writing a
# byte at a time cost this process ~4 us a byte and Envoy more. A token event is 100-300
# bytes (vLLM's ~200), so a whole answer is far above the average it must keep.
MIN_RESPONSE_PIECE_BYTES = 32
# An engine's answer that ends with neither a finish_reason nor [DONE] (``Meter.whole``).
CUT_SHORT = "engine stream ended before its answer did (no finish_reason, no DONE event)"
# After [DONE] the answer is whole (``Phase.ANSWERED``): what follows is not read, and the
# engine's body is awaited this long before Narwhal ends the client's response itself
# (ending it at [DONE] would make Envoy reset the upstream connection whenever the body's
# end comes in a later read: a new connection to vLLM for some requests, measured).
ANSWERED_GRACE_S = 1.0


@dataclass(slots=True)
class Headers:
    """Reply to a headers message: continue, with these mutations."""

    response: bool
    set: list[tuple[str, str]] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)
    destination: str | None = None  # also: clear Envoy's route cache, the route may change


@dataclass(slots=True)
class Body:
    response: bool
    data: bytes
    end_of_stream: bool


@dataclass(slots=True)
class Trailers:
    response: bool


@dataclass(slots=True)
class Immediate:
    error: HttpError


Action = Headers | Body | Trailers | Immediate


class Phase(Enum):
    REQUEST_HEADERS = auto()
    REQUEST_BODY = auto()
    MEASURING = auto()  # a long prompt being tokenized off the event loop
    QUEUED = auto()
    UPSTREAM = auto()
    RESPONSE_BODY = auto()
    ANSWERED = auto()  # [DONE] came: the answer is whole, the engine's body not yet ended
    DONE = auto()


@dataclass(frozen=True, slots=True)
class Measured:
    """A prompt's size in tokens and what its text tells placement (``Exchange.measure``)."""

    tokens: int
    prompt: PromptFacts


class Exchange:
    """State for one client request, completion or pass-through."""

    __slots__ = ("router", "phase", "completion", "path", "buf", "request", "engine", "meter",
                 "relay", "assembler", "parser", "status", "terminal", "sized", "upstream_error",
                 "request_ended", "request_bytes", "response_bytes", "held", "arrival",
                 "deadline", "budget_s", "tpot_budget_s", "priority", "flow", "ticket", "wake_at",
                 "client_headers_sent", "last_token_at", "strip", "engine_seen", "request_id",
                 "candidates", "decided_at", "ended_at", "error_code", "trace_headers", "recorded",
                 "token_id_fault", "reply", "parked", "held_bytes", "response_held",
                 "trailers_after", "request_pieces", "response_credit")

    def __init__(self, router: Router) -> None:
        self.router = router
        self.phase = Phase.REQUEST_HEADERS
        self.completion = False
        self.path = ""
        self.buf: list[bytes] = []
        self.request: CompletionRequest | None = None
        self.parked: bytes | None = None  # a large queued request's body, as the client sent it
        self.held_bytes = 0  # counted against serving.max_held_bytes (router.held_bytes)
        self.response_held = 0  # of which the response's (its largest yet)
        self.trailers_after = False  # the client's trailers, answered after the body
        self.engine: EngineState | None = None
        self.meter: Meter | None = None
        self.relay: Relay | None = None
        self.assembler: Assembler | None = None
        self.parser: SSEParser | None = None
        self.status = 0
        self.terminal: str | None = None
        self.sized = False
        self.upstream_error = False
        self.request_ended = False
        self.request_bytes = 0
        self.request_pieces = 0
        self.response_credit = BODY_PIECES_FREE * MIN_RESPONSE_PIECE_BYTES
        self.response_bytes = 0
        self.held = False
        self.arrival = 0.0
        self.deadline = 0.0
        self.budget_s = 0.0
        self.tpot_budget_s: float | None = None
        self.priority = 0  # its objective's (admission.objectives)
        self.flow = ""  # its fairness ID (admission.fairness)
        self.ticket: Ticket | None = None
        self.wake_at: float | None = None  # when ``expire`` must run (the adapter's timer)
        self.client_headers_sent = False
        self.last_token_at = 0.0
        self.strip: list[str] = []  # client headers not to forward
        self.engine_seen = 0.0  # its response headers, its latest output token, its [DONE]
        self.request_id = ""  # Envoy's x-request-id: how its access log names this exchange
        self.candidates: frozenset[str] | None = None  # endpoints allowed (subset hint)
        self.decided_at: float | None = None  # when admission answered
        self.ended_at = 0.0
        self.error_code: str | None = None
        self.trace_headers: tuple[tuple[str, str], ...] = ()
        self.recorded = False
        self.token_id_fault = False  # failed on an event without valid token IDs
        self.reply: ReplyText | None = None  # the generated text, for the prefix index

    # -- request ---------------------------------------------------------------
    def request_headers(self, headers: dict[str, str], end_of_stream: bool,
                        subset: list[str] | None = None) -> list[Action]:
        """``subset``: the gateway's ``envoy.lb.subset_hint`` endpoints, if it sent one."""
        if self.phase is not Phase.REQUEST_HEADERS:
            # A peer that sends request headers twice on one stream gets nothing for the
            # second: counting it again would hold a retention slot no terminal releases.
            return []
        path = headers.get(":path", "").split("?", 1)[0]
        self.path = path
        method = headers.get(":method", "")
        prefixes = STEERING_PREFIXES
        if not self.router.config.serving.forward_control_headers:
            prefixes += CONTROL_PREFIXES
        self.strip = [k for k in headers if k.startswith(prefixes)]
        self.candidates = self._candidates(headers, subset)
        if path not in COMPLETION_PATHS:
            if (method, path) not in PASSTHROUGH:
                # Only named paths exist: a variant (``//``, ``%2F``, a trailing ``/``) of a
                # completion route must not reach an engine around admission.
                self.phase = Phase.DONE
                return [Immediate(errors.not_found(path))]
            return self._passthrough_headers(end_of_stream)
        self.completion = True
        self.request_id = headers.get("x-request-id", "")
        if "traceparent" in headers:
            self.trace_headers = tuple((k, headers[k][:512]) for k in TRACE_HEADERS
                                       if k in headers)
        self.router.accounting.offer()
        if method != "POST":
            return self._refuse(errors.HttpError(405, f"{path} takes POST",
                                                 "invalid_request_error", errors.INVALID))
        reason = self.router.not_ready_reason()
        if reason is not None:
            return self._refuse(errors.not_serving(reason))
        limit = self.router.config.serving.max_request_bytes
        length = headers.get("content-length")
        if length is not None and _decimal(length, limit + 1) > limit:
            return self._refuse(errors.request_too_large(limit))
        adm = self.router.config.admission
        if self.router.held >= adm.retention_limit:
            return self._refuse(errors.retention_full())
        self.router.held += 1
        self.held = True
        try:
            budget_ms = _ms_header(headers, SLO_HEADER, adm.ttft_target_ms, adm.max_ttft_target_ms)
            timeout_ms = _ms_header(headers, TIMEOUT_HEADER, adm.request_timeout_ms,
                                    adm.request_timeout_ms)
            tpot_ms = (_ms_header(headers, TPOT_HEADER, adm.tpot_target_ms, 60_000)
                       if TPOT_HEADER in headers or adm.tpot_target_ms else 0)
        except HttpError as exc:
            return self._refuse(exc)
        now = self.router.clock()
        self.arrival = now
        # What admission and placement hold the request to: its budget, or the configured
        # share of it (a shorter queue, a shorter tail).
        self.budget_s = budget_ms * adm.ttft_target_share / 1000
        self.tpot_budget_s = tpot_ms / 1000 if tpot_ms else None
        objectives = self.router.objectives
        if objectives:
            objective = next((headers[k] for k in OBJECTIVE_HEADERS if k in headers), "")
            self.priority = objectives.get(objective, 0)
        if adm.fairness != "none":
            flow = next((headers[k] for k in FAIRNESS_HEADERS if k in headers), "")
            if len(flow) > MAX_FLOW_BYTES:  # header values arrive as latin-1: bytes
                return self._refuse(errors.invalid_request(
                    f"header {FAIRNESS_HEADERS[0]}: at most {MAX_FLOW_BYTES} bytes",
                    FAIRNESS_HEADERS[0]))
            self.flow = flow
        self.deadline = now + timeout_ms / 1000
        self._arm(min(self.deadline, self._body_end()))
        self.phase = Phase.REQUEST_BODY
        if end_of_stream:
            return self.request_body(b"", True)
        return []

    def _candidates(self, headers: dict[str, str], subset: list[str] | None
                    ) -> frozenset[str] | None:
        allowed = None if subset is None else frozenset(subset)
        if self.router.config.router.conformance_hooks:
            wanted = headers.get(CONFORMANCE_SELECTION)
            if wanted is not None:
                picked = frozenset(p.strip() for p in wanted.split(",") if p.strip())
                allowed = picked if allowed is None else allowed & picked
        return allowed

    def _passthrough_headers(self, end_of_stream: bool) -> list[Action]:
        ranked = self.router.scheduler.place_passthrough(self.router.clock(), self.candidates)
        if not ranked:
            return [Immediate(errors.backend_unavailable())]
        self.phase = Phase.UPSTREAM
        self.request_ended = end_of_stream
        dest = ",".join(e.endpoint for e in ranked)
        return [Headers(False, destination=dest, set=[(DESTINATION_HEADER, dest)],
                        remove=self.strip)]

    def request_body(self, chunk: bytes, end_of_stream: bool) -> list[Action]:
        if self.request_ended:
            return []  # Envoy may re-deliver the final chunk of large bodies
        if not self.completion:
            if self.phase is Phase.DONE:
                return []
            self.request_ended = end_of_stream
            if (err := self._unbounded_body(chunk)) is not None:
                self.phase = Phase.DONE  # a pass-through is not counted: nothing to release
                return [Immediate(err)]
            return [Body(False, chunk, end_of_stream)]
        if self.phase is not Phase.REQUEST_BODY:
            return []
        if (err := self._unbounded_body(chunk)) is not None:
            return self._refuse(err)
        self.buf = pieces.held(self.buf, chunk)  # a body trickled in small chunks: folded
        if not self._take(len(chunk)):
            return self._refuse(errors.held_bytes_full(self.router.config.serving.max_held_bytes))
        if not end_of_stream:
            return []
        self.request_ended = True
        raw = b"".join(self.buf)
        self.buf = []
        try:
            req = parse_request(self.path, raw, self.router.config.serving.model)
        except HttpError as exc:
            return self._refuse(exc)
        self.request = req
        self.sized = True
        self._arm(self.deadline)  # the body is whole: its deadline alone until admitted
        if self.router.sizer.offloads(req.prompt_bytes):
            # The tokenizer's work on a long prompt runs off the event loop (0.5-0.8 s for
            # 1 MB here, every other stream stopped meanwhile): the adapter runs
            # ``measure`` in a thread and goes on with ``measured``.
            self.phase = Phase.MEASURING
            self.buf = [raw]
            self.router.measuring.append(self)
            return []
        return self._admit(raw, self.measure())

    def _unbounded_body(self, chunk: bytes) -> HttpError | None:
        """Count one more piece of the request body: the error that ends the request where
        the body is now past ``serving.max_request_bytes`` or in too many small pieces
        (``BODY_PIECES_FREE``)."""
        self.request_bytes += len(chunk)
        self.request_pieces += 1
        limit = self.router.config.serving.max_request_bytes
        if self.request_bytes > limit:
            return errors.request_too_large(limit)
        if _fragmented(self.request_pieces, self.request_bytes, MIN_PIECE_BYTES):
            return errors.request_body_fragmented(self.request_pieces, BODY_PIECES_FREE,
                                                  MIN_PIECE_BYTES)
        return None

    def measure(self) -> Measured:
        """The prompt's tokens and what its text tells placement: the tokenizer's work.
        Reads the request and configuration only: safe to run in a thread."""
        req = self.request
        assert req is not None
        router = self.router
        return Measured(router.sizer.estimate(req.prompt_bytes, req.prompt_text),
                        router.scheduler.prompt_facts(req.chat, req.body))

    def measured(self, m: Measured) -> list[Action]:
        """The prompt measured off the event loop: admission goes on, unless the request
        ended meanwhile (its client left, its deadline passed)."""
        if self.phase is not Phase.MEASURING or self.terminal is not None:
            return []
        self.phase = Phase.REQUEST_BODY
        (raw,) = self.buf
        self.buf = []
        return self._admit(raw, m)

    def _admit(self, raw: bytes, m: Measured) -> list[Action]:
        """Admission of the whole, measured request: a ticket, its held bytes, the
        scheduler's decision."""
        req = self.request
        assert req is not None
        now = self.router.clock()
        self.ticket = Ticket(self, m.tokens, self.arrival, self.budget_s, self.deadline,
                             candidates=self.candidates, tpot_budget_s=self.tpot_budget_s,
                             priority=self.priority, flow=self.flow)
        self.router.scheduler.annotate(self.ticket, req.chat, req.body, req.max_tokens,
                                       m.prompt)
        if not self._take(self.ticket.held()):  # its prompt's hashes, held to its end
            return self._refuse(errors.held_bytes_full(self.router.config.serving.max_held_bytes))
        lead = self.router.leadership
        leased_at = 0.0
        if lead is not None:
            # The lease is checked on a fresh clock, and the wall time read with it is the
            # admission's time on its log line: a process frozen (SIGSTOP, a long pause)
            # after this check logs on resume, and its line must say when the lease
            # allowed the decision, not when the line was written.
            leased_at = self.router.wall()
            checked = self.router.clock()
            if not lead.leading(checked):  # lost the lease since its headers
                return self._refuse(errors.not_serving(lead.reason(checked) or "fenced"))
        decision = self.router.scheduler.admit(self.ticket, now)
        self.decided_at = now
        if isinstance(decision, Refuse):
            return self._refuse(decision.error)
        if lead is not None:  # the fencing token, on every admitted request's log line
            log.info("admitted request_id=%s lease=%s holder=%s at=%.6f", self.request_id,
                     lead.token, lead.identity, leased_at)
        if isinstance(decision, Queued):
            self.phase = Phase.QUEUED
            # Held as its bytes while it waits, parsed again to go; a small body stays
            # parsed where the budget has room for it so (its bytes are counted already).
            if self.request_bytes > PARK_BYTES \
                    or not self._take((PARSED_HELD - 1) * self.request_bytes):
                self.parked = raw
                self.request = req.without_body()
            self._arm(min(self.deadline, now + self.router.config.admission.max_wait_ms / 1000))
            # An engine no earlier queued request could use may take it now (the scheduler's
            # pump); the driver then sends it (``dispatched_from_queue``).
            self.router.pump(if_slot_free=True)
            return []
        assert isinstance(decision, Dispatch)
        return self._upstream()

    def dispatched_from_queue(self) -> list[Action]:
        """The scheduler placed this queued request: what sends it upstream (or, where
        the queue gave it up, its refusal). Run in another exchange's or a background
        loop's turn, so a failure here must end this request alone."""
        if self.phase is not Phase.QUEUED or self.terminal is not None:
            return []
        if self.ticket is not None and self.ticket.refusal is not None:
            return self._refuse(self.ticket.refusal)
        try:
            self._arm(self.deadline)
            return self._upstream()
        except Exception as exc:
            log.exception("queued request failed at dispatch")
            return self.internal_error(exc)

    def _upstream(self) -> list[Action]:
        if self.parked is not None:  # as validated at admission: the same bytes, the same request
            self.request = parse_request(self.path, self.parked, self.router.config.serving.model)
            self.parked = None
        req, ticket = self.request, self.ticket
        assert req is not None and ticket is not None and ticket.engine is not None
        engine = self.engine = ticket.engine
        token_ids = engine.token_ids and req.ids_compatible
        self.expect_response(token_ids)
        body = upstream_body(req, token_ids)
        self.request = req.without_body()  # the body is on its way (PARK_BYTES)
        self._give_back()  # the body is on its way: what is counted now is the response's
        self._take(ticket.held())  # and the prompt's hashes (less than was given back)
        self.phase = Phase.UPSTREAM
        # The chosen engine first, then its ranked fallbacks (the endpoint-picker protocol).
        dest = ",".join([engine.endpoint, *(e.endpoint for e in ticket.fallbacks)])
        actions: list[Action] = [
            Headers(False, destination=dest,
                    set=[(DESTINATION_HEADER, dest),
                         ("content-length", str(len(body)))],
                    remove=["accept-encoding", "transfer-encoding", *self.strip]),
            *_bodies(False, body),
        ]
        if self.trailers_after:
            return _with_trailers(actions)
        return actions

    def expect_response(self, token_ids: bool) -> None:
        """What reads the engine's answer: ``token_ids`` when the upstream body asks for
        them (the worker that takes over a dispatched exchange builds the same)."""
        req = self.request
        assert req is not None
        self.meter = Meter(req.chat, token_ids, req.max_tokens)
        self.parser = SSEParser(self.router.config.serving.max_event_bytes)
        if req.stream:
            # Hide only the IDs Narwhal asked for; what the client asked for, it gets.
            self.relay = Relay(req.return_token_ids or not token_ids, req.include_usage)
        else:
            self.assembler = Assembler(req.chat, req.return_token_ids)
        if req.stream and self.router.config.scheduler.prefix_index_blocks:
            self.reply = ReplyText(req.chat)  # an assembly keeps the text already

    def handed_off(self) -> None:
        """A worker process drives the response from now on (``serving.workers``): its
        timers and its record are the worker's; what it reports comes back as
        ``ended_elsewhere`` and ``Control`` calls."""
        self.wake_at = None
        self.recorded = True

    def ended_elsewhere(self, terminal: str, out: Outcome) -> None:
        """The worker that drove the response ended it: release here what it held."""
        if self.terminal is None:
            self._ended(terminal, out)

    def request_trailers(self) -> list[Action]:
        """Trailers end a request body that never said end_of_stream: size and admit it
        now; the rewritten body stays open because Envoy forwards the trailers after it."""
        if not (self.completion and self.phase is Phase.REQUEST_BODY):
            return [Trailers(False)]
        actions = self.request_body(b"", True)
        if not actions and self.phase in (Phase.MEASURING, Phase.QUEUED):
            # Its body goes upstream later (``_upstream``): Envoy takes the replies in
            # order, so the trailers' comes after the body's, then.
            self.trailers_after = True
            return []
        return _with_trailers(actions)

    # -- response --------------------------------------------------------------
    def response_headers(self, headers: dict[str, str], end_of_stream: bool,
                         served: str | None = None) -> list[Action]:
        """``served``: the endpoint Envoy reports it connected to (``envoy.lb`` metadata);
        when a fallback served, the request is accounted there from now on."""
        status = headers.get(":status", "0")
        self.status = _decimal(status, 999)
        if served and self.ticket is not None:
            self.router.control.served_by(self, served)
        if not self.completion:
            return [Headers(True)]
        if self.phase is not Phase.UPSTREAM:
            return []
        self.phase = Phase.RESPONSE_BODY
        self.engine_seen = self.router.clock()
        self._arm_stall()
        ctype = headers.get("content-type", "")
        if self.status == 200 and not ctype.startswith("text/event-stream"):
            return self._refuse(errors.engine_failure(
                f"engine answered a stream request with content-type {ctype or 'none'!r}"))
        if self.status != 200:
            self.upstream_error = True
        elif self.relay is not None:
            self.client_headers_sent = True
            out: list[Action] = [Headers(True, set=self._info_headers(),
                                         remove=["content-length"])]
            if end_of_stream:
                out += self.response_body(b"", True)
            return out
        if end_of_stream:
            return self.response_body(b"", True)
        return []  # held: the assembled body decides status and content-length

    def _info_headers(self) -> list[tuple[str, str]]:
        out = []
        t = self.ticket
        if t is not None and t.predicted_ttft_s is not None:
            out.append((PREDICTED_HEADER, str(round(t.predicted_ttft_s * 1000))))
            out.append((PREDICTED_OUTPUT_HEADER, str(t.predicted_output)))
            out.append((PREDICTED_CACHED_HEADER, str(t.predicted_cached)))
        if self.router.config.router.conformance_hooks and self.engine is not None:
            out.append((CONFORMANCE_SERVED, self.engine.endpoint))
        return out

    def response_body(self, chunk: bytes, end_of_stream: bool) -> list[Action]:
        if not self.completion:
            if end_of_stream:
                self._settle_passthrough()
            return [Body(True, chunk, end_of_stream)]
        if self.phase is not Phase.RESPONSE_BODY:
            if self.phase is Phase.ANSWERED and end_of_stream:
                return self._answered_end()
            return []  # after [DONE]: nothing more is read (nor relayed, nor counted)
        if self.upstream_error:
            return self._upstream_error(chunk, end_of_stream)
        # The pieces bound as one running balance (this runs for every token event):
        # bytes come in, MIN_RESPONSE_PIECE_BYTES go out a piece, the free pieces' worth
        # to start with.
        credit = self.response_credit + len(chunk) - MIN_RESPONSE_PIECE_BYTES
        self.response_credit = credit
        if credit < 0:
            return self._end_failed(errors.engine_failure(
                f"engine sent its answer in pieces of under {MIN_RESPONSE_PIECE_BYTES} bytes "
                f"on average (past the first {BODY_PIECES_FREE} pieces)"))
        try:
            if self.relay is not None:
                return self._stream(chunk, end_of_stream)
            return self._assemble(chunk, end_of_stream)
        except (EngineOutputError, TokenIdError, SSEError) as exc:
            return self._engine_fault(exc)

    def response_trailers(self) -> list[Action]:
        return [Trailers(True)]

    def _events(self, chunk: bytes, end_of_stream: bool) -> list[bytes]:
        assert self.parser is not None
        events = self.parser.feed(chunk) if chunk else []
        if end_of_stream:
            events += self.parser.close()
        return events

    def _stream(self, chunk: bytes, end_of_stream: bool) -> list[Action]:
        meter, relay, reply = self.meter, self.relay, self.reply
        assert meter is not None and relay is not None
        out: list[bytes] = []
        tokens = 0
        answered = False
        try:
            for raw in self._events(chunk, end_of_stream):
                if raw == b"[DONE]":
                    self._flush_relay(out)
                    out.append(DONE)
                    meter.done = answered = True
                    break  # what follows [DONE] is no part of the answer
                event = _decode(raw)
                tokens += meter.observe(event, raw)
                if reply is not None:
                    reply.event(event)
                data = relay.event(event, raw)
                if data is not None:
                    out.append(data)
        except EngineErrorEvent as exc:
            if tokens:
                self._tokens(tokens)
            return self._stream_error(out, exc)
        if tokens:
            self._tokens(tokens)
        if answered:
            self._answered()
        partial = self.parser.held()  # an event the engine is still sending (not a token's)
        if reply is not None:
            partial += reply.held  # and the reply's text, for the prefix index
        if partial > self.response_held and (ended := self._outgrown(partial, out)):
            return ended
        if end_of_stream:
            if not meter.whole:
                return self._end_failed(errors.engine_failure(CUT_SHORT), out)
            self._flush_relay(out)
            if not meter.done:
                out.append(DONE)  # a whole answer: the client's stream ends as vLLM's does
            self._finish(errors.COMPLETED)
        elif not out:
            return []
        return [Body(True, b"".join(out), end_of_stream)]

    def _flush_relay(self, out: list[bytes]) -> None:
        assert self.relay is not None
        held = self.relay.flush()
        if held is not None:
            out.append(held)

    def _stream_error(self, out: list[bytes], exc: EngineErrorEvent) -> list[Action]:
        """An error event: before any token the engine refused the request, and the client
        gets the engine's own event and ``[DONE]`` as from vLLM directly; after tokens the
        decode failed, and the client gets Narwhal's error event with no ``[DONE]``."""
        assert self.meter is not None
        if self.meter.first_token_seen:
            return self._end_failed(errors.engine_failure(str(exc)), out)
        out += (b"data: " + exc.raw + b"\n\n", DONE)
        self._finish(errors.INVALID if exc.status < 500 else errors.FAILED)
        return [Body(True, b"".join(out), True)]

    def _assemble(self, chunk: bytes, end_of_stream: bool) -> list[Action]:
        meter, assembler = self.meter, self.assembler
        assert meter is not None and assembler is not None and self.request is not None
        self.response_bytes += len(chunk)
        limit = self.router.config.serving.max_response_bytes
        if self.response_bytes > limit:
            raise EngineOutputError(f"engine response exceeds serving.max_response_bytes ({limit})")
        tokens = 0
        answered = False
        try:
            for raw in self._events(chunk, end_of_stream):
                if raw == b"[DONE]":
                    meter.done = answered = True
                    break  # what follows [DONE] is no part of the answer
                event = _decode(raw)
                tokens += meter.observe(event, raw)
                assembler.feed(event)
        except EngineErrorEvent as exc:
            if meter.first_token_seen or tokens:
                raise
            return self._engine_refusal(exc)
        if tokens:
            self._tokens(tokens)
        if answered:
            self._answered()
        held = assembler.held + self.parser.held()  # and the event still being received
        if held > self.response_held and (ended := self._outgrown(held)):
            return ended
        if not end_of_stream:
            return []
        return self._assembled()

    def _assembled(self) -> list[Action]:
        """The engine's answer ended: the assembled response, or the failure to make one."""
        meter, assembler = self.meter, self.assembler
        assert meter is not None and assembler is not None
        if not meter.whole:
            return self._end_failed(errors.engine_failure(CUT_SHORT))
        usage = meter.usage or self._computed_usage()
        body = assembler.body(usage)
        self._finish(errors.COMPLETED)
        self.client_headers_sent = True
        return [Headers(True, set=[("content-type", "application/json"),
                                   ("content-length", str(len(body))), *self._info_headers()]),
                *_bodies(True, body)]

    def _answered(self) -> None:
        """[DONE] came (``Phase.ANSWERED``): the engine's body gets ``ANSWERED_GRACE_S`` to
        end, as vLLM's does at once, before the client's response is ended without it."""
        if self.phase is Phase.RESPONSE_BODY:
            self.phase = Phase.ANSWERED
            self.engine_seen = self.router.clock()
            self._arm(self.engine_seen + ANSWERED_GRACE_S)

    def _answered_end(self) -> list[Action]:
        """End an answered request (the engine's body ended, or the grace ran out): a
        stream's client already has every event and ``[DONE]``; an assembly goes now."""
        if self.relay is None:
            return self._assembled()
        self._finish(errors.COMPLETED)
        return [Body(True, b"", True)]

    def _engine_refusal(self, exc: EngineErrorEvent) -> list[Action]:
        """The engine refused the request in its stream before any token: a non-streaming
        client gets the status and envelope vLLM answers such a request with directly."""
        return self._refuse(errors.engine_refusal(exc.status, exc.error))

    def _tokens(self, n: int) -> None:
        """Output tokens arrived: the first frees the prefill slot; later ones time TPOT."""
        now = self.router.clock()
        t = self.ticket
        first = t is not None and t.first_token_at is None
        self.router.control.token(self, now, first)  # it left at the end of an engine step
        self.engine_seen = now  # progress: the stall timer reads this when it fires
        if first:
            self.router.control.first_token(self, now)
            # The budget's wait is over: the stall timeout alone now. Only where that is
            # sooner than the timer armed (a budget past the stall timeout); otherwise
            # the timer re-arms lazily when it fires, and no timer moves per request.
            stall_end = self._stall_end()
            if self.wake_at is not None and stall_end < self.wake_at:
                self._arm_stall(stall_end)
        self.last_token_at = now

    def _computed_usage(self) -> dict[str, int]:
        assert self.meter is not None and self.request is not None
        prompt = self.meter.prompt_token_ids
        if prompt is None:
            prompt = self.ticket.tokens if self.ticket else 1
        out = self.meter.output_tokens
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}

    def _engine_fault(self, exc: Exception) -> list[Action]:
        if isinstance(exc, TokenIdError):
            self.token_id_fault = True
        return self._end_failed(errors.engine_failure(str(exc)))

    def _end_failed(self, err: HttpError, out: list[bytes] | None = None) -> list[Action]:
        """End a request that failed. A stream whose headers are out gets what is still
        pending (``out``, the relay's held event) and a final error event, no ``[DONE]``;
        anything else gets the error response."""
        if self.relay is not None and self.client_headers_sent:
            out = [] if out is None else out
            # a held event that cannot be written is dropped: the error event says why
            with contextlib.suppress(EngineOutputError):
                self._flush_relay(out)
            out.append(err.sse_event())
            self._finish(errors.FAILED)
            return [Body(True, b"".join(out), True)]
        return self._refuse(err)

    def _upstream_error(self, chunk: bytes, end_of_stream: bool) -> list[Action]:
        self.buf = pieces.held(self.buf, chunk)
        self.response_bytes += len(chunk)
        if self.response_bytes > self.router.config.serving.max_event_bytes:
            return self._refuse(errors.engine_failure(
                f"engine answered HTTP {self.status} with an oversized body"))
        if ended := self._outgrown(self.response_bytes):
            return ended
        if not end_of_stream:
            return []
        raw = b"".join(self.buf)
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            parsed = None
        if not (isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)):
            return self._refuse(errors.engine_failure(
                f"engine answered HTTP {self.status} without an error envelope"))
        self._finish(errors.INVALID if 400 <= self.status < 500 else errors.FAILED)
        return [Headers(True, set=[("content-type", "application/json"),
                                   ("content-length", str(len(raw)))]),
                Body(True, raw, True)]

    # -- endings ---------------------------------------------------------------
    def _refuse(self, err: HttpError) -> list[Action]:
        self.error_code = str(err.code or err.type)
        if not self.status:
            self.status = err.status
        self._finish(err.terminal)
        return [Immediate(err)]

    def _finish(self, terminal: str) -> None:
        if self.terminal is not None:
            return
        self._release(terminal)
        self._count(terminal)

    def _count(self, terminal: str) -> None:
        """The request's one terminal class (possibly some time after its release)."""
        self.terminal = terminal
        self.router.control.count(self, terminal)

    def _release(self, terminal: str) -> None:
        """Give back everything the request holds: retention, timers, its engine slot."""
        self.wake_at = None
        meter = self.meter
        out = Outcome(last_token_at=self.last_token_at, token_id_fault=self.token_id_fault)
        if meter is not None:
            usage = meter.usage
            prompt = usage.get("prompt_tokens") if usage is not None else None
            out = Outcome(meter.output_tokens, prompt if type(prompt) is int else None,
                          self.last_token_at, self.token_id_fault,
                          self._reply() if terminal == errors.COMPLETED else None)
        self._ended(terminal, out)

    def _reply(self) -> str | None:
        """The reply the prefix index learns (None: the index is off)."""
        if self.reply is not None:
            return self.reply.text()
        if self.assembler is not None and self.router.config.scheduler.prefix_index_blocks:
            return self.assembler.reply()
        return None

    def _ended(self, terminal: str, out: Outcome) -> None:
        self._give_back()
        self.terminal = terminal
        self.phase = Phase.DONE
        self.ended_at = self.router.clock()
        self.router.control.release(self, terminal, out)

    def _take(self, n: int) -> bool:
        """Count ``n`` more bytes this request holds against ``serving.max_held_bytes``
        (all of this process's requests together); False, counting nothing, where they
        do not fit."""
        router = self.router
        if router.held_bytes + n > router.config.serving.max_held_bytes:
            return False
        router.held_bytes += n
        self.held_bytes += n
        return True

    def _outgrown(self, held: int, out: list[bytes] | None = None) -> list[Action] | None:
        """The response now holds ``held`` bytes (its assembly or error body, the reply's
        text for the prefix index, and the event still arriving): the growth counted
        against ``serving.max_held_bytes``, or, past it, what ends the request (503, or a
        stream's final error event)."""
        if self._take(held - self.response_held):
            self.response_held = held
            return None
        return self._end_failed(errors.held_bytes_full(
            self.router.config.serving.max_held_bytes, response=True), out)

    def _give_back(self) -> None:
        self.router.held_bytes -= self.held_bytes
        self.held_bytes = 0

    def _settle_passthrough(self) -> None:
        self.phase = Phase.DONE

    def internal_error(self, exc: BaseException) -> list[Action]:
        """A bug in Narwhal: answer 500 if the client can still be told, count it failed."""
        return self._end_failed(errors.HttpError(
            500, f"internal router error: {type(exc).__name__}", "internal_error", errors.FAILED))

    # -- time ------------------------------------------------------------------
    def _arm(self, when: float) -> None:
        self.wake_at = when

    def expire(self) -> list[Action]:
        """``wake_at`` came: 408 if the body is still arriving past its timeout, 504 if
        the admission wait or the deadline has run out before response headers, or the
        engine stalled while responding. Sets ``wake_at`` again when it still has a time
        to watch."""
        self.wake_at = None
        if self.terminal is not None or not self.completion or self.phase is Phase.DONE \
                or self.phase is Phase.REQUEST_HEADERS:
            return []  # no timer of this exchange is armed outside these phases
        now = self.router.clock()
        if self.phase is Phase.RESPONSE_BODY:
            return self._stall_check(now)
        if self.phase is Phase.ANSWERED:
            end = self.engine_seen + ANSWERED_GRACE_S
            if now >= end - TIMER_SLACK:
                return self._answered_end()  # the engine keeps its body open past [DONE]
            self._arm(end)
            return []
        if self.client_headers_sent:
            return []
        # The phase's own wait, watched beside the deadline: the body's arrival, or the
        # admission queue's; past its end, and before the deadline's, it ends the request.
        t = self.ticket
        wait_end = None
        if self.phase is Phase.REQUEST_BODY:
            wait_end = self._body_end()
        elif self.phase is Phase.QUEUED and t is not None and t.queued_at is not None:
            wait_end = t.queued_at + self.router.config.admission.max_wait_ms / 1000
        if wait_end is not None and wait_end < self.deadline and now >= wait_end - TIMER_SLACK:
            return self._refuse(
                errors.request_body_timeout(self.router.config.serving.request_body_timeout_ms)
                if self.phase is Phase.REQUEST_BODY
                else errors.terminal_expiry("the admission wait expired"))
        if now >= self.deadline - TIMER_SLACK:
            return self._refuse(errors.terminal_expiry("the request deadline expired"))
        self._arm(self.deadline if wait_end is None else min(wait_end, self.deadline))
        return []

    def _body_end(self) -> float:
        """When a body still arriving is too slow: ``serving.request_body_timeout_ms``
        after its headers. A slow upload (a few bytes now and then) would otherwise hold
        its retention slot, and its bytes, until the request's deadline: the retention
        limit's 1,024 such uploads refuse every other request for 600 s."""
        return self.arrival + self.router.config.serving.request_body_timeout_ms / 1000

    def _arm_stall(self, stall_end: float | None = None) -> None:
        """Arm the stall timer (``stall_end``: ``_stall_end()``, where already computed)."""
        if stall_end is None:
            stall_end = self._stall_end()
        self._arm(stall_end if self.relay is not None else min(stall_end, self.deadline))

    def _stall_end(self) -> float:
        """When the engine's silence becomes a stall: the stall timeout after its latest
        output token (before the first, after its response headers), and before the first
        token never sooner than the request's TTFT budget runs out.

        Bytes that carry no output are no progress: SSE comments (the keepalives a proxy
        in front of an engine may send), events without tokens, a partial event. An
        engine that keeps the connection alive while generating nothing would otherwise
        hold its slot for as long as ``serving.max_response_bytes`` lasts.

        The budget: admission promised the first token within it, so an engine
        whose own queue holds it that long is doing what was projected; a budget past the
        stall timeout (``x-slo-ttft-ms`` up to ``admission.max_ttft_target_ms``) was
        otherwise broken by Narwhal itself, a request ended as stalled while the engine
        would have answered it in time.

        Nor, before the first token, while the engine is answering others (a token from it
        within the stall timeout), up to the request's deadline: a request silent in a
        working engine is waiting in its queue, which open admission lets grow past any
        budget (seen in the scheduling benchmark's open-mode calibration, where the
        slowest engine's requests were all ended as stalled while it served them in
        turn). An engine silent to every request for the stall timeout is stalled."""
        stall_s = self.router.config.serving.engine_stall_timeout_ms / 1000
        end = self.engine_seen + stall_s
        t = self.ticket
        if t is not None and t.first_token_at is None:
            end = max(end, t.arrival + t.budget_s)
            e = self.engine
            active = None if e is None else e.model.last_step_at
            if active is not None:
                end = max(end, min(active + stall_s, self.deadline))
        return end

    def _stall_check(self, now: float) -> list[Action]:
        """The engine has made no progress for serving.engine_stall_timeout_ms
        (``_stall_end``): fail the request and free its slot, rather than hold it until the
        client gives up. One timer per request, re-armed lazily from ``engine_seen``, so
        tokens cost no timer work."""
        stall_end = self._stall_end()
        if now >= stall_end - TIMER_SLACK:
            return self._end_failed(errors.engine_stalled(
                self.router.config.serving.engine_stall_timeout_ms))
        if not self.client_headers_sent:
            if now >= self.deadline - TIMER_SLACK:
                return self._refuse(errors.terminal_expiry("the request deadline expired"))
            stall_end = min(stall_end, self.deadline)
        self._arm(stall_end)
        return []

    def close(self) -> None:
        """The ext_proc stream ended. Unfinished before an engine was involved: cancelled.
        Unfinished while an engine was responding: the client left or the engine failed,
        which only Envoy knows; the verdict comes from its access log (``CloseVerdicts``)."""
        if not self.completion:
            self._settle_passthrough()
        elif self.terminal is None:
            if self.phase is Phase.ANSWERED and self.relay is not None:
                # The client has every event and [DONE] (a client may close there before
                # the engine's body ends): a whole answer, not a cancel.
                self._finish(errors.COMPLETED)
            elif self.phase in (Phase.UPSTREAM, Phase.RESPONSE_BODY, Phase.ANSWERED):
                self._release(errors.CANCELLED)
                self.router.control.closed(self, self.router.clock())
            else:
                self._finish(errors.CANCELLED)


    def record(self) -> ExchangeRecord | None:
        """The exchange's record, once, after it ended (None: not a completion request,
        not over yet, or already taken)."""
        if self.recorded or not self.completion or self.terminal is None:
            return None
        self.recorded = True
        req, t, meter = self.request, self.ticket, self.meter
        usage = meter.usage if meter is not None else None
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return ExchangeRecord(
            request_id=self.request_id,
            chat=req.chat if req else self.path.endswith("chat/completions"),
            model=str(req.body.get("model", "")) if req else "", stream=bool(req and req.stream),
            max_tokens=req.max_tokens if req else None, terminal=self.terminal,
            status=self.status, error_code=self.error_code, arrival=self.arrival,
            decided_at=self.decided_at, queued=bool(t and self.decided_at is not None
                                                    and t.dispatched_at > self.decided_at),
            dispatched_at=t.dispatched_at if t and t.engine else None,
            first_token_at=t.first_token_at if t else None, ended_at=self.ended_at,
            engine=self.engine.name if self.engine else None,
            endpoint=self.engine.endpoint if self.engine else None,
            fallbacks=tuple(e.endpoint for e in t.fallbacks) if t else (),
            failover=bool(t and t.failover),
            predicted_ttft_s=t.predicted_ttft_s if t else None, budget_s=self.budget_s,
            prompt_tokens=prompt if isinstance(prompt, int) else (t.tokens if t else None),
            output_tokens=meter.output_tokens if meter is not None else None,
            trace_headers=self.trace_headers, priority=self.priority, flow=self.flow)


def _fragmented(pieces: int, size: int, min_bytes: int) -> bool:
    """A body of ``size`` bytes in ``pieces`` pieces: past ``BODY_PIECES_FREE`` of them,
    do they bring fewer than ``min_bytes`` each on average?"""
    return (pieces - BODY_PIECES_FREE) * min_bytes > size


def _with_trailers(actions: list[Action]) -> list[Action]:
    """A request's replies when its client sent trailers: the rewritten body stays open
    (Envoy forwards the trailers after it), then the trailers' own reply."""
    if actions and isinstance(actions[-1], Body):
        actions[-1].end_of_stream = False
    return [*actions, Trailers(False)]


def _bodies(response: bool, data: bytes) -> list[Body]:
    """A whole body as streamed chunks of at most MAX_BODY_CHUNK bytes, the last ending it."""
    if len(data) <= MAX_BODY_CHUNK:
        return [Body(response, data, True)]
    last = len(data) - 1
    return [Body(response, data[i:i + MAX_BODY_CHUNK], i + MAX_BODY_CHUNK > last)
            for i in range(0, len(data), MAX_BODY_CHUNK)]


def _decimal(value: str, cap: int) -> int:
    """A header's non-negative decimal value, saturating at ``cap``; -1 if it is not one.
    ASCII digits only: ``str.isdigit`` also accepts characters such as superscript two,
    which ``int`` refuses; and the length is bounded before ``int`` sees it."""
    if not (value.isascii() and value.isdigit()):
        return -1
    if len(value) > len(str(cap)):
        return cap
    return min(int(value), cap)


def _ms_header(headers: dict[str, str], name: str, default: int, cap: int) -> float:
    """A positive millisecond header, clamped to ``cap``; the default when absent.

    Decimal milliseconds (``2.5``, up to three places) are accepted as llm-d's endpoint
    picker reads these headers: a fast engine's TPOT is a few milliseconds, where whole
    milliseconds are too coarse a budget. Digits and one point only (no sign, exponent or
    non-ASCII digit), and the integer part is bounded before ``int`` sees it."""
    value = headers.get(name)
    if value is None:
        return default
    whole, point, fraction = value.strip().partition(".")
    ms: float = _decimal(whole, cap)
    if point:
        frac = _decimal(fraction, 999) if 0 < len(fraction) <= 3 else -1
        ms = -1 if ms < 0 or frac < 0 else min(ms + frac / 10 ** len(fraction), cap)
    if ms <= 0:
        raise errors.invalid_request(
            f"header {name} must be a positive number of milliseconds (at most three "
            "decimal places)", name)
    return ms


def _decode(raw: bytes) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise EngineOutputError("engine event is not valid JSON") from None
