"""Active/standby through a Lease, end to end: three Narwhal replicas (each behind its own
Envoy, as the chart's HA pods are) race for one Lease on a stand-in API server process
(``integration/kubeapi.py``: no real one can run here) while clients send traffic to all
three. The leader is frozen (SIGSTOP) past its lease, resumed, killed, and finally shut
down gracefully. Every admitted request is logged with the lease's fencing token by the
replica that admitted it; from those logs the suite checks that at no instant did two
replicas admit."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from narwhal.launch import SimSpec, Stack

from . import kubeapi
from .conftest import MODEL, wait_for

LEASE_MS, RENEW_MS, RETRY_MS = 2000, 1500, 250
ADMITTED = re.compile(r"admitted request_id=\S* lease=(\d+) holder=(\S+) at=([\d.]+)")
BODY = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Cluster:
    api: str
    api_proc: subprocess.Popen = field(repr=False)
    sim: Stack = field(repr=False)
    replicas: dict[str, Stack] = field(default_factory=dict, repr=False)
    stop_load: threading.Event = field(default_factory=threading.Event, repr=False)
    outcomes: dict[str, list[int]] = field(default_factory=dict, repr=False)
    threads: list[threading.Thread] = field(default_factory=list, repr=False)

    def lease(self) -> dict:
        return httpx.get(f"{self.api}/apis/coordination.k8s.io/v1/namespaces/llm/leases/"
                         "narwhal", timeout=5).json()

    def holder(self) -> str:
        return (self.lease().get("spec") or {}).get("holderIdentity") or ""

    def journal(self) -> list[dict]:
        return httpx.get(f"{self.api}/_journal", timeout=5).json()

    def ready(self, name: str) -> dict:
        return httpx.get(f"{self.replicas[name].admin_url}/ready", timeout=5).json()


def _load(cluster: Cluster, name: str, url: str) -> None:
    out = cluster.outcomes.setdefault(name, [])
    with httpx.Client(timeout=30) as client:
        while not cluster.stop_load.is_set():
            try:
                out.append(client.post(f"{url}/v1/chat/completions", json=BODY).status_code)
            except httpx.HTTPError:
                out.append(0)  # its router was killed or frozen mid-request
            cluster.stop_load.wait(0.02)  # paced: traffic shape, not synchronisation


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    api, proc = kubeapi.spawn()
    sim = Stack(sims=[SimSpec("sim-le", args=["--tpot-ms", "1"])], model=MODEL).start_sims()
    c = Cluster(api, proc, sim)
    try:
        engine = [{"name": "sim-le", "url": f"http://127.0.0.1:{sim.sims[0].port}"}]
        for name in ("replica-a", "replica-b", "replica-c"):
            c.replicas[name] = Stack(sims=[], model=MODEL, wait_ready=False, config={
                "engines": engine,
                "router": {"leader_election": {
                    "enabled": True, "identity": name, "namespace": "llm", "api_server": api,
                    "lease_duration_ms": LEASE_MS, "renew_deadline_ms": RENEW_MS,
                    "retry_period_ms": RETRY_MS}}})
        # Started one after another (each waits for its own /live), so all three race
        # for the Lease within about one retry period of each other.
        for stack in c.replicas.values():
            stack.start()
        for name, stack in c.replicas.items():
            t = threading.Thread(target=_load, args=(c, name, stack.url), daemon=True)
            t.start()
            c.threads.append(t)
        yield c
    finally:
        c.stop_load.set()
        for t in c.threads:
            t.join(30)
        for stack in c.replicas.values():
            for p in stack.procs:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGCONT)
            stack.stop()
        sim.stop()
        proc.kill()
        proc.wait(10)


def admitted(cluster: Cluster) -> list[tuple[float, int, str, str]]:
    """(time, fencing token, holder, replica) of every request any replica admitted."""
    out = []
    for name, stack in cluster.replicas.items():
        for m in ADMITTED.finditer(stack.proc("narwhal").log.read_text(errors="replace")):
            out.append((float(m[3]), int(m[1]), m[2], name))
    return sorted(out)


def test_exactly_one_of_three_racing_replicas_leads(cluster):
    leader = wait_for(cluster.holder)
    for name in cluster.replicas:
        ready = wait_for(lambda n=name: cluster.ready(n).get("reason") != "starting"
                                 and cluster.ready(n))
        assert ready["ready"] is (name == leader), (name, ready)
        if name != leader:
            assert ready["reason"] == "standby"
    creates = [j for j in cluster.journal() if j["verb"] == "create"]
    assert len(creates) == 1  # the others' creates were refused (409 AlreadyExists)
    # Traffic to the standbys is refused with the reason; the leader serves.
    wait_for(lambda: 200 in cluster.outcomes.get(leader, []))
    standby = next(n for n in cluster.replicas if n != leader)
    resp = httpx.post(f"{cluster.replicas[standby].url}/v1/chat/completions", json=BODY,
                      timeout=10)
    assert resp.status_code == 503 and "standby" in resp.json()["error"]["message"]
    # A gateway's gRPC readiness check on the ext_proc port says the same.
    for name, stack in cluster.replicas.items():
        with grpc.insecure_channel(f"127.0.0.1:{stack.extproc_port}") as ch:
            got = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status
        want = health_pb2.HealthCheckResponse.SERVING if name == leader else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        assert got == want, name
        metrics = httpx.get(f"{stack.admin_url}/metrics", timeout=5).text
        assert f"narwhal_leader {1.0 if name == leader else 0.0}" in metrics, name


def test_a_frozen_leader_is_replaced_and_fenced_on_resume(cluster):
    leader = wait_for(cluster.holder)
    proc = cluster.replicas[leader].proc("narwhal").popen
    proc.send_signal(signal.SIGSTOP)
    try:
        successor = wait_for(lambda: (h := cluster.holder()) != leader and h)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert successor in cluster.replicas
    # On resume its renew deadline has passed: it refuses before it reads anything.
    ready = cluster.ready(leader)
    assert ready["ready"] is False and ready["reason"] == "fenced"
    resp = httpx.post(f"{cluster.replicas[leader].url}/v1/chat/completions", json=BODY,
                      timeout=10)
    assert resp.status_code == 503 and "fenced" in resp.json()["error"]["message"]
    assert cluster.ready(successor)["ready"] is True


def test_a_killed_leader_is_replaced_within_the_lease_duration(cluster):
    leader = wait_for(cluster.holder)
    before = len(cluster.journal())
    cluster.replicas[leader].proc("narwhal").popen.kill()
    killed_at = time.time()
    successor = wait_for(lambda: (h := cluster.holder()) != leader and h)
    taken = next(j for j in cluster.journal()[before:] if j["spec"].get("holderIdentity")
                 == successor)
    # The protocol's bound: expiry is noticed at the standby's next step after the lease
    # duration, and the takeover write is that step's.
    assert taken["at"] - killed_at <= (LEASE_MS + 2 * RETRY_MS) / 1000
    wait_for(lambda: cluster.ready(successor)["ready"])


def test_graceful_shutdown_hands_the_lease_over_without_waiting_for_expiry(cluster):
    leader = wait_for(cluster.holder)
    alive = [n for n, s in cluster.replicas.items()
             if n != leader and s.proc("narwhal").popen.poll() is None]
    assert alive
    before = len(cluster.journal())
    cluster.replicas[leader].proc("narwhal").stop()  # SIGTERM
    successor = wait_for(lambda: (h := cluster.holder()) != leader and h)
    journal = cluster.journal()[before:]
    released = next(j for j in journal if j["spec"].get("holderIdentity") == "")
    taken = next(j for j in journal if j["spec"].get("holderIdentity") == successor)
    assert released["revision"] < taken["revision"]
    # It did not wait out the lease: the next read after the release took it.
    assert taken["at"] - released["at"] < LEASE_MS / 1000


def test_no_two_replicas_ever_admitted_at_once(cluster):
    cluster.stop_load.set()
    for t in cluster.threads:
        t.join(30)
    log = admitted(cluster)
    assert len({r for _, _, _, r in log}) >= 3  # leadership really moved around
    holders: dict[int, set[str]] = {}
    for _, token, holder, replica in log:
        assert holder == replica
        holders.setdefault(token, set()).add(replica)
    assert all(len(h) == 1 for h in holders.values()), holders  # one replica per token
    tokens = [token for _, token, _, _ in log]
    # In time order the fencing token never goes back: admissions under an older lease
    # all came before any under a newer one.
    assert tokens == sorted(tokens)
