"""`engines: {discovery: kubernetes}` end to end: Narwhal watches a stand-in API server
process (``integration/kubeapi.py``; no real one can run here) while the test changes
EndpointSlices, Pods and an InferencePool, and clients go through Envoy."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from narwhal.launch import SimSpec, Stack

from . import kubeapi
from .conftest import MODEL, wait_for

BODY = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
SLICES = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
PODS = "/api/v1/namespaces/llm/pods"
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools"


@pytest.fixture(scope="module")
def world() -> Iterator[dict]:
    api, proc = kubeapi.spawn()
    sims = Stack(sims=[SimSpec("k-a", args=["--engine-name", "a"]),
                       SimSpec("k-b", args=["--engine-name", "b"]),
                       SimSpec("k-c", args=["--engine-name", "c"])], model=MODEL)
    try:
        sims.start_sims()
        yield {"api": api, "proc": proc, "ports": {s.name[-1]: s.port for s in sims.sims}}
    finally:
        sims.stop()
        proc.kill()  # open watch streams would hold a graceful stop
        proc.wait(10)


def router(world: dict, **discovery) -> Stack:
    members = [f"127.0.0.1:{p}" for p in world["ports"].values()]
    stack = Stack(sims=[], model=MODEL, wait_ready=False, envoy_engines=members, config={
        "engines": {"discovery": "kubernetes", "namespace": "llm",
                    "api_server": world["api"], "interval_ms": 200, **discovery}})
    return stack.start()


def eligible(stack: Stack) -> set[str]:
    st = httpx.get(f"{stack.admin_url}/status", timeout=5).json()
    return {e["endpoint"] for e in st["engines"] if e["eligible"]}


def names(stack: Stack) -> set[str]:
    return {e["name"] for e in httpx.get(f"{stack.admin_url}/status", timeout=5).json()["engines"]}


def served_by(stack: Stack) -> str:
    resp = httpx.post(f"{stack.url}/v1/chat/completions", json=BODY, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-sim-engine"]


def put(world: dict, path: str, obj: dict, method: str = "POST") -> None:
    url = world["api"] + path + ("" if method == "POST" else f"/{obj['metadata']['name']}")
    resp = httpx.request(method, url, json=obj, timeout=5)
    assert resp.status_code in (200, 201), resp.text


def a_slice(name: str, port: int, ready: bool = True) -> dict:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/service-name": "vllm"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": port}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready}}]}


def test_endpointslices_of_a_service_are_the_pool(world):
    ports = world["ports"]
    stack = router(world, name="vllm")
    try:
        a, b = f"127.0.0.1:{ports['a']}", f"127.0.0.1:{ports['b']}"
        assert names(stack) == set()
        put(world, SLICES, a_slice("vllm-1", ports["a"]))
        # Another Service's slice is not ours.
        put(world, SLICES, a_slice("other-1", ports["c"]) | {"metadata": {
            "name": "other-1", "labels": {"kubernetes.io/service-name": "other"}}})
        wait_for(lambda: eligible(stack) == {a})
        assert served_by(stack) == "a"
        put(world, SLICES, a_slice("vllm-2", ports["b"]))
        wait_for(lambda: eligible(stack) == {a, b})
        put(world, SLICES, a_slice("vllm-1", ports["a"], ready=False), "PUT")  # a not ready
        wait_for(lambda: eligible(stack) == {b})
        assert all(served_by(stack) == "b" for _ in range(4))
        httpx.delete(world["api"] + SLICES + "/vllm-2", timeout=5)
        wait_for(lambda: not names(stack))
        resp = httpx.post(f"{stack.url}/v1/chat/completions", json=BODY, timeout=30)
        assert resp.status_code == 503
    finally:
        stack.stop()


def test_pods_an_inferencepool_selects_are_the_pool_and_survive_an_api_outage(world):
    port_c = world["ports"]["c"]
    put(world, POOLS, {"metadata": {"name": "pool"}, "spec": {
        "selector": {"matchLabels": {"app": "vllm-c"}}, "targetPorts": [{"number": port_c}],
        "endpointPickerRef": {"name": "narwhal", "port": {"number": 9002}}}})

    def pod(name: str, ready: bool, app: str = "vllm-c") -> dict:
        return {"metadata": {"name": name, "labels": {"app": app}},
                "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [
                    {"type": "Ready", "status": "True" if ready else "False"}]}}

    put(world, PODS, pod("vllm-c-0", ready=False))
    put(world, PODS, pod("unrelated", ready=True, app="web"))
    stack = router(world, name="pool", source="inferencepool")
    try:
        c = f"127.0.0.1:{port_c}"
        assert names(stack) == set()  # the only selected Pod is not ready
        put(world, PODS, pod("vllm-c-0", ready=True), "PUT")
        wait_for(lambda: eligible(stack) == {c})
        assert served_by(stack) == "c" and names(stack) == {f"vllm-c-0:{port_c}"}
        # The API server goes away: the watch fails, the last known pool keeps serving.
        world["proc"].kill()
        world["proc"].wait(10)
        log = stack.proc("narwhal")
        wait_for(lambda: "discovery watch on pool" in log.log.read_text())
        assert served_by(stack) == "c" and eligible(stack) == {c}
    finally:
        stack.stop()
