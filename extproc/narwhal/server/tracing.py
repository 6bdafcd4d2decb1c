"""OpenTelemetry spans for completion requests, from each exchange's record once it is over
(``core/record.py``): nothing is traced on the data path itself; the spans are built after
the fact with the recorded times, and exported in batches over OTLP/gRPC.

One trace per request, continuing the W3C ``traceparent`` the client sent (Envoy forwards
it): ``narwhal.request`` with children ``narwhal.admission`` (headers to the admission
decision), ``narwhal.queue`` (when it waited for a slot), ``narwhal.placement`` (the engine
chosen, its fallbacks, the projection) and the upstream exchange, named and attributed after
the OpenTelemetry GenAI semantic conventions (``chat {model}``: ``gen_ai.*`` attributes,
time to first token).
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..config import Tracing
from ..core import errors
from ..core.record import ExchangeRecord

PROPAGATOR = TraceContextTextMapPropagator()


class Tracer:
    def __init__(self, cfg: Tracing, exporter: SpanExporter | None = None) -> None:
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        insecure = not cfg.endpoint.startswith("https://")
        self.exporter = exporter or OTLPSpanExporter(endpoint=cfg.endpoint, insecure=insecure)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter,
                                                            schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("narwhal")

    def shutdown(self) -> None:
        self.provider.shutdown()

    def record(self, r: ExchangeRecord | None) -> None:
        if r is None:
            return
        # Monotonic seconds to epoch nanoseconds, with one offset for the whole record.
        offset = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        ctx = PROPAGATOR.extract(dict(r.trace_headers)) if r.trace_headers else None
        operation = "chat" if r.chat else "text_completion"
        root = self.tracer.start_span("narwhal.request", context=ctx, kind=SpanKind.SERVER,
                                      start_time=ns(r.arrival), attributes=_root_attrs(r))
        failed = r.terminal not in (errors.COMPLETED,)
        if failed:
            root.set_status(Status(StatusCode.ERROR, r.error_code or r.terminal))
        parent = trace.set_span_in_context(root)
        decided = r.decided_at if r.decided_at is not None else r.ended_at
        adm = self.tracer.start_span("narwhal.admission", context=parent,
                                     start_time=ns(r.arrival), attributes={
                                         "narwhal.ttft_budget_ms": round(r.budget_s * 1000),
                                         "narwhal.admitted": r.dispatched_at is not None
                                         or r.queued, "narwhal.priority": r.priority})
        if r.flow:
            adm.set_attribute("narwhal.flow", r.flow)
        if r.dispatched_at is None and r.error_code:
            adm.set_attribute("narwhal.refusal", r.error_code)
        adm.end(end_time=ns(decided))
        if r.queued:
            until = r.dispatched_at if r.dispatched_at is not None else r.ended_at
            self.tracer.start_span("narwhal.queue", context=parent,
                                   start_time=ns(decided)).end(end_time=ns(until))
        if r.dispatched_at is not None:
            place: dict[str, Any] = {"narwhal.engine": r.engine or "",
                                     "narwhal.fallbacks": list(r.fallbacks),
                                     "narwhal.failover": r.failover}
            if r.predicted_ttft_s is not None:
                place["narwhal.predicted_ttft_ms"] = round(r.predicted_ttft_s * 1000, 1)
            self.tracer.start_span("narwhal.placement", context=parent,
                                   start_time=ns(r.dispatched_at),
                                   attributes=place).end(end_time=ns(r.dispatched_at))
            up = self.tracer.start_span(f"{operation} {r.model}", context=parent,
                                        kind=SpanKind.CLIENT, start_time=ns(r.dispatched_at),
                                        attributes=_upstream_attrs(r, operation))
            if failed:
                up.set_status(Status(StatusCode.ERROR, r.error_code or r.terminal))
            up.end(end_time=ns(r.ended_at))
        root.end(end_time=ns(r.ended_at))


def _root_attrs(r: ExchangeRecord) -> dict[str, Any]:
    attrs: dict[str, Any] = {"narwhal.outcome": r.terminal, "gen_ai.request.model": r.model,
                             "narwhal.stream": r.stream}
    if r.request_id:
        attrs["narwhal.request_id"] = r.request_id
    if r.status:
        attrs["http.response.status_code"] = r.status
    return attrs


def _upstream_attrs(r: ExchangeRecord, operation: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.request.model": r.model,
                             "gen_ai.system": "vllm"}
    if r.endpoint:
        host, _, port = r.endpoint.rpartition(":")
        attrs["server.address"] = host.strip("[]")
        if port.isdigit():
            attrs["server.port"] = int(port)
    if r.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = r.max_tokens
    if r.prompt_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = r.prompt_tokens
    if r.output_tokens is not None:
        attrs["gen_ai.usage.output_tokens"] = r.output_tokens
    if r.first_token_at is not None and r.dispatched_at is not None:
        attrs["gen_ai.server.time_to_first_token"] = round(r.first_token_at - r.dispatched_at, 6)
        attrs["narwhal.ttft_s"] = round(r.first_token_at - r.arrival, 6)  # as the client saw
    return attrs
