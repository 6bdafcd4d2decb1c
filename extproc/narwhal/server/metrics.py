"""Prometheus exposition of the core's counters, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core.router import Router


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
        inflight = GaugeMetricFamily("narwhal_engine_in_flight", "Requests placed on an engine",
                                     labels=["engine"])
        healthy = GaugeMetricFamily("narwhal_engine_healthy", "1 when the engine's health check "
                                    "passes", labels=["engine"])
        tokens = CounterMetricFamily("narwhal_engine_output_tokens",
                                     "Identified output tokens per engine", labels=["engine"])
        failures = CounterMetricFamily("narwhal_engine_measurement_failures",
                                       "Decode attempts failed on token identity",
                                       labels=["engine"])
        profiled = GaugeMetricFamily("narwhal_engine_profiled", "1 when the engine's profile "
                                     "is current (it may take work)", labels=["engine"])
        profile_failures = CounterMetricFamily("narwhal_engine_profile_failures",
                                               "Profiling attempts that failed", labels=["engine"])
        drift = GaugeMetricFamily("narwhal_engine_ttft_drift", "Recent mean signed relative "
                                  "TTFT error (measured - predicted) / measured",
                                  labels=["engine"])
        resets = CounterMetricFamily("narwhal_engine_drift_resets", "Times the engine's model "
                                     "was found drifted and re-learned", labels=["engine"])
        failovers = CounterMetricFamily("narwhal_engine_failovers", "Requests placed on the "
                                        "engine but served by a fallback (it did not answer)",
                                        labels=["engine"])
        hit = GaugeMetricFamily("narwhal_engine_prefix_hit_rate", "Prefix-cache hit rate the "
                                "engine reports (its vllm:prefix_cache_* counters)",
                                labels=["engine"])
        predicted_hit = GaugeMetricFamily("narwhal_engine_prefix_predicted_hit_rate",
                                          "Share of dispatched prompts Narwhal's prefix index "
                                          "expected cached", labels=["engine"])
        index_blocks = GaugeMetricFamily("narwhal_engine_prefix_index_blocks", "Prompt blocks "
                                         "in the engine's prefix index", labels=["engine"])
        index_evictions = CounterMetricFamily("narwhal_engine_prefix_index_evictions",
                                              "Blocks evicted from the engine's prefix index",
                                              labels=["engine"])
        kv_blocks = GaugeMetricFamily("narwhal_engine_kv_event_blocks", "Prefix-cache blocks "
                                      "the engine reports holding (engines[].kv_events)",
                                      labels=["engine"])
        kv_live = GaugeMetricFamily("narwhal_engine_kv_events_live", "1 while the engine's KV "
                                    "events flow and placement matches its reported blocks",
                                    labels=["engine"])
        kv_errors = CounterMetricFamily("narwhal_engine_kv_event_errors", "Unreadable KV event "
                                        "batches and sequence gaps (each forgets the blocks)",
                                        labels=["engine"])
        now = self.router.clock()
        for eng in self.router.engines:
            if eng.kv is not None:
                kv_blocks.add_metric([eng.name], len(eng.kv.by_engine))
                kv_live.add_metric([eng.name], 1 if eng.kv.live(now) else 0)
                kv_errors.add_metric([eng.name], eng.kv.errors)
            failovers.add_metric([eng.name], eng.failovers)
            hit.add_metric([eng.name], eng.model.hit_rate)
            predicted_hit.add_metric([eng.name], eng.predicted_hit_rate)
            index_blocks.add_metric([eng.name], len(eng.prefix.blocks))
            index_evictions.add_metric([eng.name], eng.prefix.evictions)
            inflight.add_metric([eng.name], eng.in_flight)
            healthy.add_metric([eng.name], 1 if eng.healthy else 0)
            tokens.add_metric([eng.name], eng.output_tokens)
            failures.add_metric([eng.name], eng.measurement_failures)
            profiled.add_metric([eng.name], 1 if eng.profiled else 0)
            profile_failures.add_metric([eng.name], eng.profile_failures)
            drift.add_metric([eng.name], eng.model.drift)
            resets.add_metric([eng.name], eng.model.drift_resets)
        yield from (inflight, healthy, tokens, failures, profiled, profile_failures, drift, resets,
                    failovers, hit, predicted_hit, index_blocks, index_evictions, kv_blocks,
                    kv_live, kv_errors)
        lead = self.router.leadership
        if lead is not None:
            yield GaugeMetricFamily("narwhal_leader", "1 while this replica holds the Lease "
                                    "and may admit", value=1 if lead.leading(now) else 0)
            yield CounterMetricFamily("narwhal_leader_acquisitions", "Times this replica "
                                      "acquired the Lease", value=lead.acquisitions)
        yield GaugeMetricFamily("narwhal_admission_queue_length", "Requests waiting for a slot",
                                value=len(self.router.scheduler.queue))
        yield GaugeMetricFamily("narwhal_requests_held", "Requests inside the retention limit",
                                value=self.router.held)
