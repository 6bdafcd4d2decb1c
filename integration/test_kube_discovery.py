"""`engines: {discovery: kubernetes}` end to end: Narwhal watches a stand-in API server
process (``integration/kubeapi.py``; no real one can run here) while the test changes
EndpointSlices, Pods, an InferencePool and its InferenceObjectives, and clients go
through Envoy."""

from __future__ import annotations

import concurrent.futures
import contextlib
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


def a_pool(name: str, app: str, *ports: int) -> dict:
    """An InferencePool (v1) selecting the Pods labelled ``app=<app>``, on ``ports``."""
    return {"metadata": {"name": name}, "spec": {
        "selector": {"matchLabels": {"app": app}},
        "targetPorts": [{"number": port} for port in ports],
        "endpointPickerRef": {"name": "narwhal", "port": {"number": 9002}}}}


def a_pod(name: str, app: str, ready: bool = True) -> dict:
    """A running Pod on 127.0.0.1 (where every simulator listens), labelled ``app``."""
    return {"metadata": {"name": name, "labels": {"app": app}},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


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


def test_an_edit_of_the_inferencepool_is_followed_at_once(world):
    """The pool's selector and target ports are followed, not read once: selecting other
    Pods moves the pool to them, and a second target port adds the engine on it."""
    ports = world["ports"]
    put(world, POOLS, a_pool("moving", "mv-a", ports["a"]))
    for name, app in (("mv-a-0", "mv-a"), ("mv-b-0", "mv-b")):
        put(world, PODS, a_pod(name, app))
    stack = router(world, name="moving", source="inferencepool")
    try:
        a, b, c = (f"127.0.0.1:{ports[x]}" for x in "abc")
        wait_for(lambda: eligible(stack) == {a})
        assert served_by(stack) == "a"
        put(world, POOLS, a_pool("moving", "mv-b", ports["b"]), "PUT")
        wait_for(lambda: eligible(stack) == {b} and names(stack) == {f"mv-b-0:{ports['b']}"})
        assert served_by(stack) == "b"
        put(world, POOLS, a_pool("moving", "mv-b", ports["b"], ports["c"]), "PUT")
        wait_for(lambda: eligible(stack) == {b, c})
        log = stack.proc("narwhal").log.read_text()
        assert "discovery watch on moving failed" not in log  # followed, not re-listed
        assert log.count("InferencePool moving changed its selector") == 2
    finally:
        stack.stop()


def test_pods_an_inferencepool_selects_are_the_pool_and_survive_an_api_outage(world):
    port_c = world["ports"]["c"]
    put(world, POOLS, a_pool("pool", "vllm-c", port_c))
    put(world, PODS, a_pod("vllm-c-0", "vllm-c", ready=False))
    put(world, PODS, a_pod("unrelated", "web"))
    stack = router(world, name="pool", source="inferencepool")
    try:
        c = f"127.0.0.1:{port_c}"
        assert names(stack) == set()  # the only selected Pod is not ready
        put(world, PODS, a_pod("vllm-c-0", "vllm-c"), "PUT")
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


OBJECTIVES = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/llm/inferenceobjectives"


def objective(name: str, priority: int | None, pool: str = "pool") -> dict:
    spec: dict = {"poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                              "name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"metadata": {"name": name}, "spec": spec}


@contextlib.contextmanager
def one_pod_pool(engine: str, sim_args: list[str], absent: tuple[str, ...] = ()
                 ) -> Iterator[dict]:
    """Its own API server (without the kinds ``absent`` names), serving an InferencePool
    ``pool`` that selects one running, ready Pod: a simulator named ``engine``."""
    api, proc = kubeapi.spawn(absent)
    sims = Stack(sims=[SimSpec(f"k-{engine}", args=["--engine-name", engine, *sim_args])],
                 model=MODEL)
    try:
        sims.start_sims()
        port = sims.sims[0].port
        world = {"api": api, "proc": proc, "ports": {engine: port}}
        put(world, POOLS, a_pool("pool", engine, port))
        put(world, PODS, a_pod(f"{engine}-0", engine))
        yield world
    finally:
        sims.stop()
        proc.kill()
        proc.wait(10)


@pytest.fixture()
def slow_pool() -> Iterator[dict]:
    """A slow engine (10 ms a token) that one request keeps busy."""
    with one_pod_pool("slow", ["--tpot-ms", "10"]) as world:
        yield world


def objectives(stack: Stack) -> dict:
    return httpx.get(f"{stack.admin_url}/status", timeout=5).json()["objectives"]


def test_the_pools_inferenceobjectives_are_request_priorities(slow_pool):
    """The InferenceObjectives whose poolRef names the pool are followed as priorities,
    over admission.objectives for their names: one created after start makes its
    requests sheddable (429 ``request_shed`` while the engine is busy), one naming a
    configured objective with priority 0 makes that objective's requests queue instead
    of being shed, another pool's objective is ignored, and a deleted one leaves the
    configured map as it was."""
    world = slow_pool
    put(world, OBJECTIVES, objective("batch", 0))  # before start: the list sees it
    stack = Stack(sims=[], model=MODEL, wait_ready=False,
                  envoy_engines=[f"127.0.0.1:{world['ports']['slow']}"], config={
                      "engines": {"discovery": "kubernetes", "namespace": "llm", "name": "pool",
                                  "source": "inferencepool", "api_server": world["api"],
                                  "interval_ms": 200},
                      "admission": {"mode": "open", "queue_limit": 4,
                                    "objectives": {"batch": -1, "interactive": 5}},
                      "scheduler": {"max_prefill_per_engine": 1, "max_decode_per_engine": 1}})
    stack.start()
    try:
        wait_for(lambda: eligible(stack))
        assert objectives(stack) == {"batch": 0, "interactive": 5}
        put(world, OBJECTIVES, objective("bulk", -5))
        put(world, OBJECTIVES, objective("elsewhere", 7, pool="another-pool"))
        put(world, OBJECTIVES, objective("interactive", 50_000))  # clamped
        wait_for(lambda: objectives(stack) == {"batch": 0, "interactive": 1000, "bulk": -5})
        url = f"{stack.url}/v1/chat/completions"

        def chat(tokens: int, name: str = "") -> httpx.Response:
            headers = {"x-gateway-inference-objective": name} if name else {}
            return httpx.post(url, json=BODY | {"max_tokens": tokens}, headers=headers,
                              timeout=30)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            busy = pool.submit(chat, 80)  # ~0.8 s on the one slot
            wait_for(lambda: httpx.get(f"{stack.admin_url}/status", timeout=5).json()[
                "requests"]["in_flight"] == 1)
            shed = chat(2, "bulk")
            assert shed.status_code == 429, shed.text
            assert shed.json()["error"]["code"] == "request_shed"
            queued = chat(2, "batch")  # configured -1, but the API server's 0: it waits
            assert queued.status_code == 200, queued.text
            assert busy.result().status_code == 200
        for name in ("bulk", "batch", "elsewhere"):
            httpx.delete(world["api"] + OBJECTIVES + f"/{name}", timeout=5)
        wait_for(lambda: objectives(stack) == {"batch": -1, "interactive": 1000})
        # An outage during which the namespace's last objective goes: the watch after it
        # starts from a fresh list, which has none (a watch alone would replay nothing,
        # and the gone objective's priority would stay).
        log = stack.proc("narwhal").log
        httpx.post(world["api"] + "/_down", timeout=5)
        wait_for(lambda: "InferenceObjective watch for pool pool failed" in log.read_text())
        gone = httpx.delete(world["api"] + OBJECTIVES + "/interactive", timeout=5,
                            headers={"x-stand-in-admin": "1"})
        assert gone.status_code == 200
        assert objectives(stack) == {"batch": -1, "interactive": 1000}  # the last known
        httpx.post(world["api"] + "/_up", timeout=5)
        wait_for(lambda: objectives(stack) == {"batch": -1, "interactive": 5})
        assert served_by(stack) == "slow"
    finally:
        stack.stop()


def test_without_the_inferenceobjective_crd_the_configured_priorities_stay():
    """A cluster without the InferenceObjective CRD: the watch's 404 is logged once (not
    every retry), the pool is discovered and served as ever, and the priorities are
    admission.objectives'."""
    with one_pod_pool("plain", [], absent=("inferenceobjectives",)) as world:
        stack = router(world, name="pool", source="inferencepool")
        try:
            wait_for(lambda: eligible(stack))
            assert served_by(stack) == "plain"
            log = stack.proc("narwhal").log
            wait_for(lambda: log.read_text().count("InferenceObjective watch") >= 1)
            # Retries every 200 ms: a request served after several has not been logged again.
            first = log.read_text()
            wait_for(lambda: httpx.get(f"{world['api']}/_absent", timeout=5).json()[
                "answered"] >= 4)
            assert served_by(stack) == "plain"
            text = log.read_text()
            assert "InferenceObjective watch for pool pool: not found (404" in first
            assert text.count("InferenceObjective watch") == 1, text
            assert objectives(stack) == {}
        finally:
            stack.stop()
