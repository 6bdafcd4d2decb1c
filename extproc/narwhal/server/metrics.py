"""Prometheus exposition of the core's counters, read at scrape time."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core.engines import EngineState
from ..core.router import Router

# Per-engine series, in exposition order: (family, name, help, the engine's value at
# ``now``; None where the engine has none, e.g. KV-event series without ``kv_events``).
EngineValue = Callable[[EngineState, float], float | None]
ENGINE_SERIES: tuple[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str,
                           EngineValue], ...] = (
    (GaugeMetricFamily, "narwhal_engine_in_flight", "Requests placed on an engine",
     lambda e, now: e.in_flight),
    (GaugeMetricFamily, "narwhal_engine_healthy", "1 when the engine's health check passes",
     lambda e, now: float(e.healthy)),
    (CounterMetricFamily, "narwhal_engine_output_tokens", "Identified output tokens per engine",
     lambda e, now: e.output_tokens),
    (CounterMetricFamily, "narwhal_engine_measurement_failures",
     "Decode attempts failed on token identity", lambda e, now: e.measurement_failures),
    (GaugeMetricFamily, "narwhal_engine_profiled",
     "1 when the engine's profile is current (it may take work)",
     lambda e, now: float(e.profiled)),
    (CounterMetricFamily, "narwhal_engine_profile_failures", "Profiling attempts that failed",
     lambda e, now: e.profile_failures),
    (GaugeMetricFamily, "narwhal_engine_ttft_drift",
     "Recent mean signed relative TTFT error (measured - predicted) / measured",
     lambda e, now: e.model.drift),
    (CounterMetricFamily, "narwhal_engine_drift_resets",
     "Times the engine's model was found drifted and re-learned",
     lambda e, now: e.model.drift_resets),
    (CounterMetricFamily, "narwhal_engine_failovers",
     "Requests placed on the engine but served by a fallback (it did not answer)",
     lambda e, now: e.failovers),
    (GaugeMetricFamily, "narwhal_engine_prefix_hit_rate",
     "Prefix-cache hit rate the engine reports (its vllm:prefix_cache_* counters)",
     lambda e, now: e.model.hit_rate),
    (GaugeMetricFamily, "narwhal_engine_prefix_predicted_hit_rate",
     "Share of dispatched prompts Narwhal's prefix index expected cached",
     lambda e, now: e.predicted_hit_rate),
    (GaugeMetricFamily, "narwhal_engine_prefix_index_blocks",
     "Prompt blocks in the engine's prefix index", lambda e, now: len(e.prefix.blocks)),
    (CounterMetricFamily, "narwhal_engine_prefix_index_evictions",
     "Blocks evicted from the engine's prefix index", lambda e, now: e.prefix.evictions),
    (GaugeMetricFamily, "narwhal_engine_kv_event_blocks",
     "Prefix-cache blocks the engine reports holding (engines[].kv_events)",
     lambda e, now: None if e.kv is None else len(e.kv.by_engine)),
    (GaugeMetricFamily, "narwhal_engine_kv_events_live",
     "1 while the engine's KV events flow and placement matches its reported blocks",
     lambda e, now: None if e.kv is None else float(e.kv.live(now))),
    (CounterMetricFamily, "narwhal_engine_kv_event_errors",
     "Unreadable KV event batches and sequence gaps (each forgets the blocks)",
     lambda e, now: None if e.kv is None else e.kv.errors),
    (CounterMetricFamily, "narwhal_engine_kv_events_replayed",
     "KV event batches recovered from the engine's replay socket (engines[].kv_replay)",
     lambda e, now: None if e.kv is None else e.kv.replayed),
)


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        acct = self.router.accounting
        yield CounterMetricFamily("narwhal_requests_offered",
                                  "Arrivals on completion routes", value=acct.offered)
        yield CounterMetricFamily("narwhal_requests_unsized_offered",
                                  "Offered requests that ended before workload sizing",
                                  value=acct.unsized_offered)
        term = CounterMetricFamily("narwhal_requests_terminal",
                                   "Requests by terminal class", labels=["class"])
        for cls, n in acct.terminal.items():
            term.add_metric([cls], n)
        yield term
        yield GaugeMetricFamily("narwhal_requests_in_flight", "Offered requests not yet terminal",
                                value=acct.in_flight)
        now = self.router.clock()
        for family, name, doc, value in ENGINE_SERIES:
            metric = family(name, doc, labels=["engine"])
            for eng in self.router.engines:
                v = value(eng, now)
                if v is not None:
                    metric.add_metric([eng.name], v)
            yield metric
        yield from prediction_errors(self.router)
        lead = self.router.leadership
        if lead is not None:
            yield GaugeMetricFamily("narwhal_leader", "1 while this replica holds the Lease "
                                    "and may admit", value=1 if lead.leading(now) else 0)
            yield CounterMetricFamily("narwhal_leader_acquisitions", "Times this replica "
                                      "acquired the Lease", value=lead.acquisitions)
        yield GaugeMetricFamily("narwhal_admission_queue_length", "Requests waiting for a slot",
                                value=len(self.router.scheduler.queue))
        by_priority = GaugeMetricFamily(
            "narwhal_admission_queue_length_by_priority", "Requests waiting for a slot, by "
            "their objective's priority (admission.objectives)", labels=["priority"])
        # An empty queue is priority 0's zero: the series exists before the first wait.
        for priority, n in (self.router.scheduler.queued_by_priority() or {0: 0}).items():
            by_priority.add_metric([str(priority)], n)
        yield by_priority
        # A count, not a label per flow: the fairness IDs are the clients' to choose.
        yield GaugeMetricFamily("narwhal_admission_queue_flows", "Flows (fairness IDs, "
                                "admission.fairness) with a request waiting for a slot",
                                value=self.router.scheduler.queued_flows())
        yield CounterMetricFamily("narwhal_admission_queue_gave_up", "Queued requests refused "
                                  "once no engine could meet their TTFT budget any more",
                                  value=self.router.scheduler.gave_up)
        yield GaugeMetricFamily("narwhal_requests_held", "Requests inside the retention limit",
                                value=self.router.held)
        yield GaugeMetricFamily("narwhal_held_bytes", "Request bodies and assembled responses "
                                "held, against serving.max_held_bytes (this process)",
                                value=self.router.held_bytes)


def prediction_errors(router: Router) -> Iterator[Metric]:
    """Relative TTFT prediction error, |predicted - measured| / measured, for the pool and
    per engine: summaries whose quantiles are the recent window's (``/status``'s p50 and
    p90) and whose ``_sum / _count`` is the lifetime mean."""
    pool = ("narwhal_ttft_prediction_error", "Relative error of the TTFT predicted at "
            "admission", [({}, router.learning.errors)])
    engines = ("narwhal_engine_ttft_prediction_error", "Relative error of the TTFT "
               "predicted at admission, per engine the request was placed on",
               [({"engine": e.name}, e.prediction_errors) for e in router.engines])
    for name, doc, windows in (pool, engines):
        metric = Metric(name, doc, "summary")
        for labels, window in windows:
            values = window.quantiles(0.5, 0.9) or [math.nan, math.nan]  # none yet: NaN
            for q, v in zip(("0.5", "0.9"), values, strict=True):
                metric.add_sample(name, {**labels, "quantile": q}, v)
            metric.add_sample(name + "_count", labels, window.count)
            metric.add_sample(name + "_sum", labels, window.total)
        yield metric


# Per worker process (serving.workers), from the /status rows Workers.status() makes.
WORKER_SERIES = (
    (GaugeMetricFamily, "narwhal_worker_up", "1 while the worker process's link is open",
     lambda w: float(w["up"])),
    (CounterMetricFamily, "narwhal_worker_restarts", "Times the worker process was started again",
     lambda w: w["restarts"]),
    (CounterMetricFamily, "narwhal_worker_streams", "ext_proc streams the worker forwarded",
     lambda w: w["streams"]),
    (CounterMetricFamily, "narwhal_worker_handoffs", "Exchanges the worker took over",
     lambda w: w["handoffs"]),
    (CounterMetricFamily, "narwhal_worker_cpu_seconds",
     "The worker process's user and system CPU time", lambda w: w["cpu_seconds"]),
    (GaugeMetricFamily, "narwhal_worker_resident_memory_bytes",
     "The worker process's resident memory", lambda w: w["rss_bytes"]),
    (CounterMetricFamily, "narwhal_worker_gc_objects_collected",
     "Objects the worker's cyclic garbage collector freed (flat while serving: a rise is "
     "a leak's sign)", lambda w: w["gc_collected"]),
    (CounterMetricFamily, "narwhal_worker_gc_objects_uncollectable",
     "Objects the worker's cyclic garbage collector could not free",
     lambda w: w["gc_uncollectable"]),
)


def process_usage(pid: int) -> tuple[float, int]:
    """A process's CPU seconds (user + system) and resident bytes, as
    ``prometheus_client``'s ProcessCollector reads them from ``/proc`` (the one this
    process's own ``process_*`` series come from), pointed at ``pid``; zeros where they
    cannot be read (gone, or not Linux)."""
    found = {m.name: m.samples[0].value
             for m in ProcessCollector(pid=lambda: pid, registry=None).collect()}
    return (found.get("process_cpu_seconds", 0.0),
            int(found.get("process_resident_memory_bytes", 0)))


class WorkersCollector(Collector):
    def __init__(self, status: Callable[[], list[dict[str, Any]]]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        rows = self.status()
        for family, name, doc, value in WORKER_SERIES:
            metric = family(name, doc, labels=["worker"])
            for w in rows:
                metric.add_metric([str(w["index"])], value(w))
            yield metric
