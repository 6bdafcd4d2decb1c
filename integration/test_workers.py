"""serving.workers through a real Envoy: the admission, conservation, reliability and soak
suites unchanged with two workers, streams spread over the workers, and a worker that dies."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import orjson
import pytest
import yaml
from bench.datapath import cpu_seconds
from grpc_health.v1 import health_pb2, health_pb2_grpc

from narwhal.launch import SimSpec, free_port

from .conftest import MODEL, _stack, client_for, status, unix_socket, wait_for

ROOT = Path(__file__).resolve().parent.parent
SUITES = ["integration/test_admission.py", "integration/test_conservation.py",
          "integration/test_hardening.py", "integration/test_drain.py",
          "integration/test_soak.py"]
MSGS = [{"role": "user", "content": "hi"}]


def test_admission_conservation_and_reliability_suites_pass_with_two_workers():
    """The same test modules, every stack with serving.workers: 2 (conftest's hook)."""
    env = {**os.environ, "NARWHAL_TEST_WORKERS": "2"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *SUITES],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout


@pytest.fixture(scope="module")
def two_workers():
    yield from _stack([SimSpec("sim-w", args=["--tpot-ms", "20"])],
                      {"serving": {"workers": 2, "extproc_socket": unix_socket()},
                       "admission": {"mode": "open"}})


def settled(stack) -> dict:
    return wait_for(lambda: (s := status(stack))["requests"]["in_flight"] == 0 and s)


def test_streams_are_spread_over_the_workers_and_handed_off(two_workers):
    before = status(two_workers)["workers"]
    client = client_for(two_workers)
    for i in range(8):
        if i % 2:
            resp = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
            assert resp.usage.completion_tokens == 3
        else:
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=3, stream=True,
                stream_options={"include_usage": True}))
            assert chunks[-1].usage.completion_tokens == 3
    st = settled(two_workers)
    after = st["workers"]
    assert [w["index"] for w in after] == [0, 1] and all(w["up"] for w in after)
    handed = [a["handoffs"] - b["handoffs"] for a, b in zip(after, before, strict=True)]
    assert sum(handed) == 8 and all(h > 0 for h in handed)  # Envoy spreads the streams
    assert all(w["open"] == 0 for w in after)
    assert st["engines"][0]["in_flight"] == 0 and st["requests"]["held"] == 0


def worker_series(stack) -> dict[tuple[str, str], float]:
    """The per-worker series on the scheduler's /metrics: (name, worker) -> value."""
    out = {}
    for line in httpx.get(f"{stack.admin_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("narwhal_worker_") and "{" in line:
            name, rest = line.split("{", 1)
            worker = rest.split('worker="', 1)[1].split('"', 1)[0]
            out[(name, worker)] = float(line.rsplit(" ", 1)[1])
    return out


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_each_workers_own_cpu_memory_and_collector_are_on_the_schedulers_metrics(two_workers):
    """The scheduler's /metrics carries its own process series; each worker's are read
    from /proc by its pid, and its collector's totals asked for when /metrics is read."""
    before = worker_series(two_workers)
    streams = [w["streams"] for w in status(two_workers)["workers"]]
    client = client_for(two_workers)
    for _ in range(12):
        resp = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
        assert resp.usage.completion_tokens == 3
    st = settled(two_workers)
    assert all(w["streams"] > n for w, n in zip(st["workers"], streams, strict=True))
    pids = {str(w["index"]): w["pid"] for w in st["workers"]}
    cpu_before = {w: cpu_seconds(pid) for w, pid in pids.items()}
    after = worker_series(two_workers)
    cpu_after = {w: cpu_seconds(pid) for w, pid in pids.items()}
    for w in ("0", "1"):
        # the worker's own CPU, read from /proc by its pid when /metrics was read (a
        # dozen requests may be under the kernel's 10 ms tick: no "it grew" check)
        cpu = after[("narwhal_worker_cpu_seconds_total", w)]
        assert cpu_before[w] - 1e-9 <= cpu <= cpu_after[w] + 1e-9, (cpu_before, cpu, cpu_after)
        assert cpu >= before[("narwhal_worker_cpu_seconds_total", w)] > 0
        rss = after[("narwhal_worker_resident_memory_bytes", w)]
        assert 0.8 * vm_rss(pids[w]) < rss < 1.25 * vm_rss(pids[w])
        # requests are freed by reference counting (start-up's garbage was collected
        # before serving: it is in the total, not in what serving adds)
        gc = "narwhal_worker_gc_objects_collected_total"
        assert after[(gc, w)] > 0 and after[(gc, w)] - before[(gc, w)] < 50, (
            after[(gc, w)], before[(gc, w)])
        assert after[("narwhal_worker_gc_objects_uncollectable_total", w)] == 0


def test_the_schedulers_step_model_times_the_steps_the_workers_relay(two_workers):
    """The engine's steps are timed in the scheduler process, as in one: each worker
    reports the tokens that follow a pause (every step's first, one frame a step), and
    the scheduler's step model measures the steps that computed prompts (none while the
    workers kept every token to themselves).

    A step is timed when it starts after a prompt was sent and before its first token, so
    a stream decodes throughout (every request below is sent while its tokens leave the
    engine step by step). Without it, the four clients' requests, sent together to an
    idle engine and answered in lockstep, sometimes never left a step start between a
    dispatch and its first token (this test failed 3-4 runs in 10)."""
    client = client_for(two_workers)

    def stream(i: int) -> int:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"steps {i} " * 40}],
            max_tokens=12, stream=True, stream_options={"include_usage": True}))
        return chunks[-1].usage.completion_tokens

    decoding = {"model": MODEL, "messages": MSGS, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{two_workers.url}/v1/chat/completions", json=decoding,
                      timeout=60) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: {")
             and (c := orjson.loads(line[6:])["choices"]) and c[0]["delta"].get("content"))
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(stream, range(12))) == [12] * 12
    st = settled(two_workers)
    assert st["engines"][0]["step_model"]["steps"] > 0


def test_a_worker_that_dies_is_started_again_and_its_requests_end(two_workers):
    before = settled(two_workers)
    old = before["workers"][0]

    def long_stream(i: int) -> str:
        """"done": a 200 stream that ended with [DONE]. A stream the dead worker held
        ends otherwise: reset after its headers, or Envoy's error reply (a 503) before."""
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 400, "stream": True}
        try:
            with httpx.stream("POST", f"{two_workers.url}/v1/chat/completions", json=body,
                              timeout=60) as resp:
                lines = [line for line in resp.iter_lines() if line]
            return "done" if resp.status_code == 200 and lines[-1:] == ["data: [DONE]"] \
                else f"ended {resp.status_code}"
        except httpx.HTTPError:
            return "cut"

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(long_stream, i) for i in range(6)]
        # Both workers hold streams that are under way (observable: the scheduler's view).
        wait_for(lambda: all(w["open"] > 0 for w in status(two_workers)["workers"]))
        os.kill(old["pid"], signal.SIGKILL)
        outcomes = [f.result() for f in futures]
    assert outcomes.count("done") < 6, outcomes  # the dead worker's clients' streams ended
    st = wait_for(lambda: (s := status(two_workers))["workers"][0]["restarts"] == 1
                  and s["workers"][0]["up"] and s["workers"][0]["pid"] != old["pid"] and s)
    sock = two_workers.config["serving"]["extproc_socket"]
    with grpc.insecure_channel(f"unix:{sock}.0") as channel:  # ready as soon as it is up
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    metrics = httpx.get(f"{two_workers.admin_url}/metrics", timeout=5).text
    assert 'narwhal_worker_restarts_total{worker="0"} 1.0' in metrics
    assert 'narwhal_worker_up{worker="1"} 1.0' in metrics
    st = settled(two_workers)
    req = st["requests"]
    assert req["held"] == 0 and req["queued"] == 0 and st["engines"][0]["in_flight"] == 0
    assert req["offered"] == sum(req["terminal"].values())  # nothing lost, nothing leaked
    # A stream the worker died holding before it forwarded anything never reached the
    # scheduler: Envoy answered it (router unavailable), and it was never offered.
    assert before["requests"]["offered"] < req["offered"] <= before["requests"]["offered"] + 6
    # And it serves again, through both workers.
    start = [w["handoffs"] for w in st["workers"]]
    deadline = time.monotonic() + 30
    while any(w["handoffs"] == s for w, s in zip(status(two_workers)["workers"], start,
                                                   strict=True)):
        assert time.monotonic() < deadline, status(two_workers)["workers"]
        resp = client_for(two_workers).chat.completions.create(model=MODEL, messages=MSGS,
                                                               max_tokens=2)
        assert resp.usage.completion_tokens == 2


def test_each_worker_answers_grpc_health_with_the_schedulers_readiness(two_workers):
    sock = two_workers.config["serving"]["extproc_socket"]
    for i in range(2):
        with grpc.insecure_channel(f"unix:{sock}.{i}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "liveness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_worker_that_cannot_start_fails_start_up_with_its_reason(tmp_path):
    sock = unix_socket()
    Path(f"{sock}.0").write_text("not a socket")  # worker 0 must not bind over a file
    cfg = tmp_path / "narwhal.yaml"
    cfg.write_text(yaml.safe_dump({
        "serving": {"workers": 2, "extproc_socket": sock, "extproc_port": free_port()},
        "telemetry": {"admin_port": free_port()},
        "engines": [{"name": "e", "url": "http://127.0.0.1:9"}]}))
    run = subprocess.run([sys.executable, "-m", "narwhal", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "worker 0 exited before it was ready" in run.stderr
    assert f"{sock}.0 exists and is not a socket" in run.stderr  # the worker's own words
