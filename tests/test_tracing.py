"""Spans from exchange records (the SDK's in-memory exporter; the OTLP path is in the
integration suite)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from narwhal.config import Tracing
from narwhal.core.record import ExchangeRecord
from narwhal.server.tracing import Tracer

BASE = ExchangeRecord(
    request_id="r1", chat=False, model="m", stream=False, max_tokens=16, terminal="completed",
    status=200, error_code=None, arrival=10.0, decided_at=10.001, queued=True,
    dispatched_at=10.5, first_token_at=10.7, ended_at=11.0, engine="e2",
    endpoint="10.0.0.2:8000", fallbacks=("10.0.0.3:8000",), failover=True,
    predicted_ttft_s=0.65, budget_s=1.0, prompt_tokens=12, output_tokens=16, trace_headers=())


def spans(record: ExchangeRecord) -> dict:
    exporter = InMemorySpanExporter()
    tracer = Tracer(Tracing(enabled=True), exporter=exporter)
    tracer.record(record)
    tracer.shutdown()
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_queued_failed_over_completion():
    got = spans(BASE)
    assert set(got) == {"narwhal.request", "narwhal.admission", "narwhal.queue",
                        "narwhal.placement", "text_completion m"}
    q = got["narwhal.queue"]
    assert (q.end_time - q.start_time) / 1e9 == pytest.approx(0.499, abs=1e-6)
    place = got["narwhal.placement"].attributes
    assert place["narwhal.failover"] is True and place["narwhal.engine"] == "e2"
    assert tuple(place["narwhal.fallbacks"]) == ("10.0.0.3:8000",)
    assert place["narwhal.predicted_ttft_ms"] == 650.0
    up = got["text_completion m"].attributes
    assert up["server.address"] == "10.0.0.2" and up["server.port"] == 8000
    assert up["gen_ai.server.time_to_first_token"] == 0.2
    root = got["narwhal.request"]
    assert root.parent is None and root.status.is_ok


def test_a_request_that_expired_in_the_queue_has_no_upstream_span():
    got = spans(replace(BASE, terminal="rejected", status=504, error_code="admission_timeout",
                        dispatched_at=None, first_token_at=None, engine=None, endpoint=None))
    assert set(got) == {"narwhal.request", "narwhal.admission", "narwhal.queue"}
    assert not got["narwhal.request"].status.is_ok



def test_the_admission_span_says_the_priority_and_the_flow():
    """An operator auditing priorities and turns finds them on the admission span: the
    objective's priority always, the fairness ID where the request had one."""
    adm = spans(replace(BASE, priority=10, flow="tenant-a"))["narwhal.admission"].attributes
    assert adm["narwhal.priority"] == 10 and adm["narwhal.flow"] == "tenant-a"
    adm = spans(BASE)["narwhal.admission"].attributes
    assert adm["narwhal.priority"] == 0 and "narwhal.flow" not in adm
