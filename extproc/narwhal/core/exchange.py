"""One HTTP exchange as ext_proc sees it: an explicit state machine, free of I/O.

The gRPC adapter calls one method per ext_proc message and sends back the actions
returned, in order. The exchange owns the request from its arrival to exactly one
terminal class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

import orjson

from . import errors
from .assembly import Assembler
from .errors import HttpError
from .meter import EngineOutputError, Meter
from .pool import EngineState
from .relay import DONE, Relay
from .request import COMPLETION_PATHS, CompletionRequest, parse_request, upstream_body
from .router import Router
from .sse import SSEError, SSEParser
from .tokens import TokenIdError

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
BYTES_PER_TOKEN = 4  # until sizing learns the engines' ratio


@dataclass(slots=True)
class Headers:
    """Reply to a headers message: continue, with these mutations."""

    response: bool
    set: list[tuple[str, str]] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)
    destination: str | None = None


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
    UPSTREAM = auto()
    RESPONSE_BODY = auto()
    DONE = auto()


class Exchange:
    """State for one client request, completion or pass-through."""

    __slots__ = ("router", "phase", "completion", "path", "buf", "request", "engine", "meter",
                 "relay", "assembler", "parser", "status", "terminal", "sized", "upstream_error",
                 "request_ended", "response_bytes")

    def __init__(self, router: Router) -> None:
        self.router = router
        self.phase = Phase.REQUEST_HEADERS
        self.completion = False
        self.path = ""
        self.buf: list[bytes] = []
        self.request: CompletionRequest | None = None
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
        self.response_bytes = 0

    # -- request ---------------------------------------------------------------
    def request_headers(self, headers: dict[str, str], end_of_stream: bool) -> list[Action]:
        path = headers.get(":path", "").split("?", 1)[0]
        self.path = path
        method = headers.get(":method", "")
        if path not in COMPLETION_PATHS:
            return self._passthrough_headers(method, end_of_stream)
        self.completion = True
        self.router.accounting.offered += 1
        if method != "POST":
            return self._refuse(errors.HttpError(405, f"{path} takes POST",
                                                 "invalid_request_error", errors.INVALID))
        reason = self.router.not_ready_reason()
        if reason is not None:
            return self._refuse(errors.not_serving(reason))
        limit = self.router.config.serving.max_request_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return self._refuse(errors.request_too_large(limit))
        self.phase = Phase.REQUEST_BODY
        if end_of_stream:
            return self.request_body(b"", True)
        return []

    def _passthrough_headers(self, method: str, end_of_stream: bool) -> list[Action]:
        engine = self.router.pool.place()
        if engine is None:
            return [Immediate(errors.backend_unavailable())]
        self.engine = engine
        self.phase = Phase.UPSTREAM
        self.request_ended = end_of_stream
        return [Headers(False, destination=engine.endpoint,
                        set=[(DESTINATION_HEADER, engine.endpoint)])]

    def request_body(self, chunk: bytes, end_of_stream: bool) -> list[Action]:
        if self.request_ended:
            return []  # Envoy may re-deliver the final chunk of large bodies
        if not self.completion:
            self.request_ended = end_of_stream
            return [Body(False, chunk, end_of_stream)] if self.phase != Phase.DONE else []
        if self.phase is not Phase.REQUEST_BODY:
            return []
        self.buf.append(chunk)
        limit = self.router.config.serving.max_request_bytes
        size = sum(len(b) for b in self.buf)
        if size > limit:
            return self._refuse(errors.request_too_large(limit))
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
        engine = self.router.pool.place()
        if engine is None:
            return self._refuse(errors.backend_unavailable())
        self.engine = engine
        self.meter = Meter(req.chat, engine.token_ids)
        self.parser = SSEParser(self.router.config.serving.max_event_bytes)
        if req.stream:
            self.relay = Relay(req.return_token_ids, req.include_usage)
        else:
            self.assembler = Assembler(req.chat, req.return_token_ids)
        body = upstream_body(req, engine.token_ids)
        self.phase = Phase.UPSTREAM
        return [
            Headers(False, destination=engine.endpoint,
                    set=[(DESTINATION_HEADER, engine.endpoint),
                         ("content-length", str(len(body)))],
                    remove=["accept-encoding", "transfer-encoding"]),
            Body(False, body, True),
        ]

    def request_trailers(self) -> list[Action]:
        return [Trailers(False)]

    # -- response --------------------------------------------------------------
    def response_headers(self, headers: dict[str, str], end_of_stream: bool) -> list[Action]:
        status = headers.get(":status", "0")
        self.status = int(status) if status.isdigit() else 0
        if not self.completion:
            return [Headers(True)]
        if self.phase is not Phase.UPSTREAM:
            return []
        self.phase = Phase.RESPONSE_BODY
        if self.status != 200:
            self.upstream_error = True
        elif self.relay is not None:
            out: list[Action] = [Headers(True, remove=["content-length"])]
            if end_of_stream:
                out += self.response_body(b"", True)
            return out
        if end_of_stream:
            return self.response_body(b"", True)
        return []  # held: the assembled body decides status and content-length

    def response_body(self, chunk: bytes, end_of_stream: bool) -> list[Action]:
        if not self.completion:
            if end_of_stream:
                self._settle_passthrough()
            return [Body(True, chunk, end_of_stream)]
        if self.phase is not Phase.RESPONSE_BODY:
            return []
        if self.upstream_error:
            return self._upstream_error(chunk, end_of_stream)
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
        meter, relay = self.meter, self.relay
        assert meter is not None and relay is not None
        out: list[bytes] = []
        for raw in self._events(chunk, end_of_stream):
            if raw == b"[DONE]":
                out.append(DONE)
                continue
            event = _decode(raw)
            meter.observe(event)
            data = relay.event(event, raw)
            if data is not None:
                out.append(data)
        if end_of_stream:
            self._finish(errors.COMPLETED)
        elif not out:
            return []
        return [Body(True, b"".join(out), end_of_stream)]

    def _assemble(self, chunk: bytes, end_of_stream: bool) -> list[Action]:
        meter, assembler = self.meter, self.assembler
        assert meter is not None and assembler is not None and self.request is not None
        self.response_bytes += len(chunk)
        limit = self.router.config.serving.max_response_bytes
        if self.response_bytes > limit:
            raise EngineOutputError(f"engine response exceeds serving.max_response_bytes ({limit})")
        for raw in self._events(chunk, end_of_stream):
            if raw == b"[DONE]":
                continue
            event = _decode(raw)
            meter.observe(event)
            assembler.feed(event)
        if not end_of_stream:
            return []
        usage = meter.usage or self._computed_usage()
        body = orjson.dumps(assembler.result(usage))
        self._finish(errors.COMPLETED)
        return [Headers(True, set=[("content-type", "application/json"),
                                   ("content-length", str(len(body)))]),
                Body(True, body, True)]

    def _computed_usage(self) -> dict[str, int]:
        assert self.meter is not None and self.request is not None
        prompt = self.meter.prompt_token_ids
        if prompt is None:
            prompt = max(1, -(-self.request.prompt_bytes // BYTES_PER_TOKEN))
        out = self.meter.output_tokens
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}

    def _engine_fault(self, exc: Exception) -> list[Action]:
        if isinstance(exc, TokenIdError) and self.engine is not None:
            self.engine.measurement_failures += 1
        err = errors.engine_failure(str(exc))
        if self.relay is not None:
            self._finish(errors.FAILED)
            return [Body(True, err.sse_event(), True)]
        return self._refuse(err)

    def _upstream_error(self, chunk: bytes, end_of_stream: bool) -> list[Action]:
        self.buf.append(chunk)
        if sum(len(b) for b in self.buf) > self.router.config.serving.max_event_bytes:
            return self._refuse(errors.engine_failure(
                f"engine answered HTTP {self.status} with an oversized body"))
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
        self._finish(err.terminal)
        return [Immediate(err)]

    def _finish(self, terminal: str) -> None:
        if self.terminal is not None:
            return
        self.terminal = terminal
        self.phase = Phase.DONE
        acct = self.router.accounting
        acct.terminal[terminal] += 1
        if not self.sized:
            acct.unsized_offered += 1
        if self.engine is not None:
            self.router.pool.release(self.engine)
            if self.meter is not None:
                self.engine.output_tokens += self.meter.output_tokens
            if terminal == errors.COMPLETED:
                self.engine.completed += 1

    def _settle_passthrough(self) -> None:
        if self.engine is not None and self.phase is not Phase.DONE:
            self.phase = Phase.DONE
            self.router.pool.release(self.engine)

    def internal_error(self, exc: BaseException) -> list[Action]:
        """A bug in Narwhal: answer 500 if the client can still be told, count it failed."""
        err = errors.HttpError(500, f"internal router error: {type(exc).__name__}",
                               "internal_error", errors.FAILED)
        if self.phase is Phase.RESPONSE_BODY and self.relay is not None:
            self._finish(errors.FAILED)
            return [Body(True, err.sse_event(), True)]
        return self._refuse(err)

    def close(self) -> None:
        """The ext_proc stream ended: whatever is unfinished was cancelled."""
        if self.completion:
            self._finish(errors.CANCELLED)
        else:
            self._settle_passthrough()


def _decode(raw: bytes) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise EngineOutputError("engine event is not valid JSON") from None
