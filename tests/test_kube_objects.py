"""Kubernetes objects to engines (discovery) and to priorities (InferenceObjectives), and
the config that turns them and leader election and tracing on."""

from __future__ import annotations

import pytest

from narwhal.config import ConfigError, Discovery, parse
from narwhal.server.kube_discovery import pod_engines, pool_selector, slice_engines
from narwhal.server.kube_objectives import objective_priority

D = Discovery(discovery="kubernetes", name="vllm", port=9999)


def test_slice_ready_endpoints_on_the_named_or_first_port():
    obj = {"ports": [{"name": "metrics", "port": 9100}, {"name": "http", "port": 8000}],
           "endpoints": [{"addresses": ["10.0.0.1"]},  # ready unset: ready
                         {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                         {"addresses": ["fd00::3"], "conditions": {"ready": True}}]}
    assert set(slice_engines(D, obj)) == {"10.0.0.1:9100", "[fd00::3]:9100"}
    named = Discovery(discovery="kubernetes", name="vllm", port_name="http")
    got = slice_engines(named, obj)
    assert set(got) == {"10.0.0.1:8000", "[fd00::3]:8000"}
    assert got["10.0.0.1:8000"].name == "vllm/10.0.0.1:8000"
    assert slice_engines(Discovery(discovery="kubernetes", name="v", port_name="grpc"), obj) == {}
    assert set(slice_engines(D, {"endpoints": [{"addresses": ["10.0.0.9"]}]})) == {
        "10.0.0.9:9999"}  # a slice without ports: the configured one


def test_inferencepool_v1_and_v1alpha2_and_pods():
    v1 = {"spec": {"selector": {"matchLabels": {"app": "vllm"}},
                   "targetPorts": [{"number": 8000}, {"number": 8001}]}}
    assert pool_selector(v1) == ({"app": "vllm"}, [8000, 8001])
    alpha = {"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000}}
    assert pool_selector(alpha) == ({"app": "vllm"}, [8000])
    pod = {"metadata": {"name": "p0"}, "status": {"phase": "Running", "podIP": "10.1.0.5",
                                                   "conditions": [{"type": "Ready",
                                                                   "status": "True"}]}}
    assert set(pod_engines(D, pod, [8000, 8001])) == {"10.1.0.5:8000", "10.1.0.5:8001"}
    assert pod_engines(D, pod | {"status": pod["status"] | {"phase": "Pending"}}, [8000]) == {}
    unready = {"metadata": {"name": "p1"}, "status": {"phase": "Running", "podIP": "10.1.0.6",
                                                       "conditions": [{"type": "Ready",
                                                                       "status": "False"}]}}
    assert pod_engines(D, unready, [8000]) == {}


def test_config_for_kubernetes_discovery_leader_election_and_tracing():
    cfg = parse({"engines": {"discovery": "kubernetes", "name": "pool",
                             "source": "inferencepool", "namespace": "llm"},
                 "router": {"leader_election": {"enabled": True}},
                 "telemetry": {"tracing": {"enabled": True, "sample_ratio": 0.25}}})
    assert cfg.discovery.source == "inferencepool" and cfg.discovery.namespace == "llm"
    assert cfg.discovery.inference_objectives  # on by default with an InferencePool
    assert cfg.router.leader_election.lease_duration_ms == 15_000
    assert cfg.telemetry.tracing.sample_ratio == 0.25
    bad = [
        ({"engines": {"discovery": "kubernetes", "name": "x", "source": "pods"}},
         "engines.source"),
        ({"router": {"leader_election": {"lease_duration_ms": 1000, "renew_deadline_ms": 2000}}},
         "renew_deadline_ms"),
        ({"router": {"role": "standby", "leader_election": {"enabled": True}}}, "router.role"),
        ({"telemetry": {"tracing": {"sample_ratio": 1.5}}}, "sample_ratio"),
        ({"scheduler": {"fallbacks": -1}}, "scheduler.fallbacks"),
        ({"engines": {"discovery": "kubernetes", "name": "x", "inference_objectives": True}},
         "engines.inference_objectives: follows the InferenceObjectives of an InferencePool"),
        ({"engines": {"discovery": "dns", "name": "x", "inference_objectives": False}},
         "needs discovery: kubernetes, source: inferencepool"),
        ({"engines": {"discovery": "kubernetes", "name": "x", "source": "inferencepool",
                      "inference_objectives": "yes"}}, "expected true or false"),
    ]
    for data, where in bad:
        with pytest.raises(ConfigError, match=where):
            parse(data)


def _objective(spec: dict) -> dict:
    return {"metadata": {"name": "o"}, "spec": spec}


def test_an_inferenceobjective_for_the_pool_is_its_priority():
    ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pool"}
    assert objective_priority(_objective({"poolRef": ref, "priority": 10}), "pool") == 10
    assert objective_priority(_objective({"poolRef": ref, "priority": -3}), "pool") == -3
    # Unset (or null) is 0, as the Extension's picker reads it.
    assert objective_priority(_objective({"poolRef": ref}), "pool") == 0
    assert objective_priority(_objective({"poolRef": ref, "priority": None}), "pool") == 0
    # Group and kind default; the experimental group's pools count too.
    assert objective_priority(_objective({"poolRef": {"name": "pool"}, "priority": 2}),
                              "pool") == 2
    x_ref = ref | {"group": "inference.networking.x-k8s.io"}
    assert objective_priority(_objective({"poolRef": x_ref, "priority": 2}), "pool") == 2
    # Beyond admission.objectives' range: clamped.
    assert objective_priority(_objective({"poolRef": ref, "priority": 2**31 - 1}), "pool") == 1000
    assert objective_priority(_objective({"poolRef": ref, "priority": -(2**31)}), "pool") == -1000
    # Another pool's, another kind's, or malformed: none.
    for spec in ({"poolRef": ref | {"name": "other"}, "priority": 1},
                 {"poolRef": ref | {"kind": "Service"}, "priority": 1},
                 {"poolRef": ref | {"group": "example.com"}, "priority": 1},
                 {"poolRef": ref, "priority": "high"}, {"poolRef": ref, "priority": True},
                 {"poolRef": ref, "priority": 1.5}, {"poolRef": "pool", "priority": 1},
                 {"priority": 1}):
        assert objective_priority(_objective(spec), "pool") is None, spec
    assert objective_priority({"metadata": {"name": "o"}}, "pool") is None
    assert objective_priority({"spec": [1]}, "pool") is None
