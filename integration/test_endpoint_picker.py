"""The endpoint-picker protocol through a real Envoy: the gateway's subset hint, route-cache
clearing, the conformance suite's test-picker hooks."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest

from narwhal.launch import SimSpec, Stack

from .conftest import MODEL, status, wait_for

MSGS = [{"role": "user", "content": "hi"}]
SUBSET_HEADER = "x-test-subset"


def add_subset_filter(cfg: dict) -> None:
    """Stand in for a gateway that sets envoy.lb.subset_hint: copy a request header into
    that metadata before the ext_proc filter (Envoy's header_to_metadata filter)."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"]["http_filters"].insert(0, {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{"header": SUBSET_HEADER, "remove": True, "on_header_present": {
                "metadata_namespace": "envoy.lb.subset_hint",
                "key": "x-gateway-destination-endpoint-subset", "type": "STRING"}}]}})


def hinted_stack(names: list[str], config: dict) -> Iterator[Stack]:
    """Simulated engines behind an Envoy that copies the subset header into the hint,
    with the conformance hooks on (the served endpoint in a response header)."""
    stack = Stack(sims=[SimSpec(n) for n in names],
                  config={"router": {"conformance_hooks": True}, **config}, model=MODEL,
                  envoy_patch=add_subset_filter)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def picker() -> Iterator[Stack]:
    yield from hinted_stack(["pick-a", "pick-b", "pick-c"], {})


def endpoints(stack: Stack) -> dict[str, str]:
    return {e["name"]: e["endpoint"] for e in status(stack)["engines"]}


def post(stack: Stack, headers: dict[str, str], stream: bool = False) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 2, "stream": stream})


@pytest.mark.parametrize("stream", [False, True])
def test_subset_hint_is_honoured(picker, stream):
    ep = endpoints(picker)
    for _ in range(6):
        resp = post(picker, {SUBSET_HEADER: ep["pick-b"]}, stream)
        assert resp.status_code == 200
        assert resp.headers["x-conformance-test-served-endpoint"] == ep["pick-b"]
    subset = f"{ep['pick-a']},{ep['pick-c']}"
    served = {post(picker, {SUBSET_HEADER: subset}).headers["x-conformance-test-served-endpoint"]
              for _ in range(8)}
    assert served <= {ep["pick-a"], ep["pick-c"]}


@pytest.fixture(scope="module")
def one_slot_each() -> Iterator[Stack]:
    yield from hinted_stack(["slot-a", "slot-b"], {"scheduler": {"max_prefill_per_engine": 1}})


def test_a_queued_request_holds_back_no_request_another_engine_can_serve(one_slot_each):
    """No head-of-line blocking, end to end: slot-a's one prefill slot is held (the
    simulator's gate holds its first token), a second request that only slot-a may serve
    waits in the queue, and a third that slot-b may serve is answered by slot-b at once
    instead of queueing behind it (strict FIFO held it until slot-a's gate opened), as is
    a fourth that either may serve."""
    ep = endpoints(one_slot_each)
    sim_a = f"http://127.0.0.1:{one_slot_each.sims[0].port}"
    pool = concurrent.futures.ThreadPoolExecutor(2)
    assert httpx.post(f"{sim_a}/sim/hold", json={"hold": True}).status_code == 200
    try:
        first = pool.submit(post, one_slot_each, {SUBSET_HEADER: ep["slot-a"]})
        wait_for(lambda: status(one_slot_each)["engines"][0]["prefill"] == 1)
        queued = pool.submit(post, one_slot_each, {SUBSET_HEADER: ep["slot-a"]})
        wait_for(lambda: status(one_slot_each)["requests"]["queued"] == 1)
        resp = post(one_slot_each, {SUBSET_HEADER: ep["slot-b"]})
        assert resp.status_code == 200
        assert resp.headers["x-conformance-test-served-endpoint"] == ep["slot-b"]
        # One that either engine may serve arrives behind the queue: it goes at once to
        # slot-b, which the queued request does not claim (admission places it beside
        # the queue), not behind it.
        resp = post(one_slot_each, {})
        assert resp.status_code == 200
        assert resp.headers["x-conformance-test-served-endpoint"] == ep["slot-b"]
        assert status(one_slot_each)["requests"]["queued"] == 1 and not queued.done()
    finally:
        httpx.post(f"{sim_a}/sim/hold", json={"hold": False})
    for fut in (first, queued):
        resp = fut.result()
        assert resp.status_code == 200
        assert resp.headers["x-conformance-test-served-endpoint"] == ep["slot-a"]
    pool.shutdown()


@pytest.mark.parametrize("subset", ["127.0.0.1:1", "10.0.0.1:8000,10.0.0.2:8000"])
def test_empty_or_foreign_subset_is_503(picker, subset):
    resp = post(picker, {SUBSET_HEADER: subset})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "backend_unavailable"
    assert resp.headers["retry-after"] == "1"


def test_conformance_selection_header(picker):
    ep = endpoints(picker)
    resp = post(picker, {"test-epp-endpoint-selection": ep["pick-c"]})
    assert resp.headers["x-conformance-test-served-endpoint"] == ep["pick-c"]
    resp = httpx.get(f"{picker.url}/v1/models", timeout=30,
                     headers={"test-epp-endpoint-selection": ep["pick-a"]})
    assert resp.status_code == 200


def test_spoofed_destination_is_ignored(picker):
    ep = endpoints(picker)
    resp = post(picker, {"x-gateway-destination-endpoint": "127.0.0.1:1",
                         SUBSET_HEADER: ep["pick-a"]})
    assert resp.status_code == 200
    assert resp.headers["x-conformance-test-served-endpoint"] == ep["pick-a"]


def test_hooks_are_off_by_default(stack):
    resp = post(stack, {"test-epp-endpoint-selection": "127.0.0.1:1"})
    assert resp.status_code == 200
    assert "x-conformance-test-served-endpoint" not in resp.headers


@pytest.fixture(scope="module")
def failover() -> Iterator[Stack]:
    # pick-fast is the engine placement prefers (pick-slow runs 5x slower); health checks
    # are minutes apart so that Narwhal still believes in pick-fast after it is killed: the
    # window between placement and connect that fallbacks exist for.
    speed = ["--tpot-ms", "2", "--prefill-tps", "20000"]
    stack = Stack(sims=[SimSpec("pick-fast", args=["--engine-name", "fast", *speed]),
                        SimSpec("pick-slow", args=["--engine-name", "slow", *speed,
                                                   "--time-scale", "5"])],
                  config={"telemetry": {"health_interval_ms": 600_000,
                                        "stale_after_ms": 3_600_000}},
                  model=MODEL)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def test_fallback_serves_when_the_chosen_engine_dies(failover):
    before = {e["name"]: e for e in status(failover)["engines"]}
    resp = post(failover, {})
    assert resp.headers["x-sim-engine"] == "fast"  # the preferred engine, while it lives
    failover.proc("pick-fast").stop()
    n = 6
    for i in range(n):
        resp = post(failover, {}, stream=i % 2 == 1)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-sim-engine"] == "slow"
        if i % 2:
            assert resp.text.rstrip().endswith("data: [DONE]")
        else:
            assert resp.json()["usage"]["completion_tokens"] == 2
    st = status(failover)
    after = {e["name"]: e for e in st["engines"]}
    fast, slow = after["pick-fast"], after["pick-slow"]
    # Each was placed on the dead engine (Narwhal has not noticed it died) and accounted
    # on the engine that served it once Envoy reported it.
    assert fast["failovers"] - before["pick-fast"]["failovers"] == n
    assert fast["in_flight"] == slow["in_flight"] == 0
    assert fast["completed"] - before["pick-fast"]["completed"] == 1
    assert slow["completed"] - before["pick-slow"]["completed"] == n
    assert slow["output_tokens"] - before["pick-slow"]["output_tokens"] == 2 * n
    assert st["requests"]["in_flight"] == 0
