"""The real-vLLM tier: vLLM 0.32 CPU servers over random-weight Llamas built at test time,
each behind its own Envoy + Narwhal. Over the tiny model, started once per test session:

* ``tools``: ``--enable-auto-tool-choice --tool-call-parser hermes``
* ``reasoning``: ``--reasoning-parser deepseek_r1``
* ``kv``: prefix caching on, publishing its KV-cache events

and over the small model, where an engine's prefill must take long enough to be seen
(~1 ms a prompt token), started for their module only: ``small`` (``small_server``,
behind ``small_pair`` and ``objectives_pair``) for the admission tests that need a
backlog held on the engine (or a request held long enough to queue others behind it),
and two publishing KV
events in one pool (``kv_pool_pair``) for placement by what each engine holds.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from narwhal.launch import Stack

from ..conftest import wait_for
from .engine import SERVED_MODEL, VllmServer, built_model, kv_server, own_cpu

VARIANTS = {
    "tools": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    "reasoning": ["--reasoning-parser", "deepseek_r1"],
}


@dataclass
class Pair:
    """One vLLM server, and Envoy + Narwhal in front of it."""

    engine: VllmServer
    stack: Stack

    def direct(self) -> httpx.Client:
        return httpx.Client(base_url=self.engine.url, timeout=120)

    def routed(self) -> httpx.Client:
        return httpx.Client(base_url=self.stack.url, timeout=120)

    def openai(self, routed: bool = True) -> openai.OpenAI:
        base = self.stack.url if routed else self.engine.url
        return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)

    def status(self) -> dict:
        return httpx.get(f"{self.stack.admin_url}/status", timeout=5).json()

    def engine_status(self) -> dict:
        return self.status()["engines"][0]

    def settled(self) -> dict:
        """``/status`` once nothing is in flight: a request's end is accounted as the
        client reads its last bytes, and with ``serving.workers`` it reaches the
        scheduler from its worker a moment after (observed: a read right after [DONE]
        counted 0 of 106 tokens)."""
        return wait_for(lambda: (s := self.status())["requests"]["in_flight"] == 0 and s)

    def settled_engine_status(self) -> dict:
        return self.settled()["engines"][0]

    def stack_counts(self) -> dict[str, int]:
        """Narwhal's terminal classes so far (every request so far ended)."""
        return self.settled()["requests"]["terminal"]


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory) -> Iterator[dict[str, VllmServer]]:
    """The servers start at once (each ~1 min and ~3 GB on 2 cores)."""
    root: Path = tmp_path_factory.mktemp("vllm")
    model = built_model(root / "model")
    servers = {name: VllmServer(f"vllm-{name}", model, root, args) for name, args in
               VARIANTS.items()}
    servers["kv"] = kv_server("vllm-kv", model, root)
    try:
        for server in servers.values():
            server.spawn()
        for server in servers.values():
            server.wait()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _pair(server: VllmServer, **extra: dict) -> Iterator[Pair]:
    """``server`` behind Envoy + Narwhal (``extra``: configuration sections that replace
    the defaults here, ``engines`` included)."""
    config = {
        "serving": {"model": SERVED_MODEL},
        # Wire fidelity is under test here, not admission: a budget no CPU prefill misses.
        "admission": {"ttft_target_ms": 120_000, "max_ttft_target_ms": 120_000},
        "engines": [server.engine_config()],
        # Two CPU vLLMs share 2 cores with the tests: /health can take seconds.
        # Their timing is CPU contention, not drift: do not re-learn on it.
        "telemetry": {"health_timeout_ms": 5000, "stale_after_ms": 30_000,
                      "drift_threshold": 0},
    } | extra
    stack = Stack(sims=[], config=config, model=SERVED_MODEL)
    stack.start()
    try:
        yield Pair(server, stack)
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def tools_pair(vllm_servers) -> Iterator[Pair]:
    yield from _pair(vllm_servers["tools"])


@pytest.fixture(scope="session")
def workers_pair(vllm_servers) -> Iterator[Pair]:
    """The tools server behind Narwhal with serving.workers: 2 (the response phase runs in
    worker processes; tokens are counted on the scheduler from their reports)."""
    yield from _pair(vllm_servers["tools"], serving=_workers_serving())


def _workers_serving() -> dict:
    """serving.workers: 2, reached over Unix sockets (as the chart's sidecar mode)."""
    sock = str(Path(tempfile.mkdtemp(prefix="nw-")) / "x.sock")
    return {"model": SERVED_MODEL, "workers": 2, "extproc_socket": sock}


# The small model's engine behind a budget of a few of its prefills (each ~1 s here).
SMALL_BUDGET_MS = 4000


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    """The small model's files, built once for the modules whose engines serve it."""
    return built_model(tmp_path_factory.mktemp("small-model") / "model", "small")


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, small_model) -> Iterator[VllmServer]:
    """vLLM over the "small" model, whose prefill takes ~1 ms a prompt token on one CPU
    thread, so that a backlog on it lasts seconds (on the tiny model it lasts
    milliseconds and cannot be held from outside). Module-scoped: its ~3 GB are given
    back when its tests end."""
    root: Path = tmp_path_factory.mktemp("vllm-small")
    server = VllmServer("vllm-small", small_model, root).spawn()
    try:
        server.wait()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def small_pair(small_server) -> Iterator[Pair]:
    """The small model's engine behind a Narwhal with a TTFT target of
    ``SMALL_BUDGET_MS``."""
    yield from _pair(small_server, admission={"ttft_target_ms": SMALL_BUDGET_MS})


OBJECTIVES = {"interactive": 10, "batch": -1}


@pytest.fixture(scope="module")
def objectives_pair(small_server) -> Iterator[Pair]:
    """The small model's engine behind a Narwhal that serves one request at a time (one
    prefill and one decode slot), with ``OBJECTIVES``' priorities: what arrives behind a
    long prompt's request (a second of prefill) queues, in priority order."""
    yield from _pair(small_server, admission={"mode": "open", "objectives": OBJECTIVES},
                     scheduler={"max_prefill_per_engine": 1, "max_decode_per_engine": 1})


@pytest.fixture(scope="session")
def reasoning_pair(vllm_servers) -> Iterator[Pair]:
    yield from _pair(vllm_servers["reasoning"])


@pytest.fixture(scope="session")
def kv_pair(vllm_servers) -> Iterator[Pair]:
    """vLLM with prefix caching and KV events; Narwhal subscribed, with the model's own
    tokenizer (and its chat template) to compute prompt token IDs."""
    yield from kv_stack(vllm_servers["kv"])


@pytest.fixture(scope="session")
def kv_workers_pair(vllm_servers) -> Iterator[Pair]:
    """The same engine behind a Narwhal with serving.workers: 2: the scheduler process
    subscribes and places; the workers relay the answers."""
    yield from kv_stack(vllm_servers["kv"], workers=True)


@pytest.fixture(scope="module")
def kv_pool_pair(tmp_path_factory, small_model) -> Iterator[Pair]:
    """Two vLLMs over the small model, prefix caching on and publishing their KV events,
    behind one Narwhal (``Pair.engine``: the first). The small model: on the tiny one a
    1,000-token prefill takes a few milliseconds, within the noise of the TTFT fit's
    first samples on this busy machine, so that a fit may learn prefill as free and
    place by other terms (seen here: a question went to the engine that did not hold
    its system prompt); at ~1 ms a token, a cached prefix is a second less. Module-scoped:
    their ~6 GB are given back when the module's tests end."""
    root: Path = tmp_path_factory.mktemp("vllm-kv-pool")
    servers = [kv_server(f"vllm-pool{i}", small_model, root, own_cpu(i)) for i in range(2)]
    try:
        for server in servers:
            server.spawn()
        for server in servers:
            server.wait()
        yield from _pair(servers[0], engines=[s.engine_config() for s in servers],
                         sizing={"tokenizer": str(small_model / "tokenizer.json")})
    finally:
        for server in servers:
            server.stop()


def kv_stack(server: VllmServer, discovered: bool = False, workers: bool = False
             ) -> Iterator[Pair]:
    """A Narwhal subscribed to ``server``'s KV events (another one may be started later:
    it learns what the engine already holds from the replay socket). ``discovered``: the
    engine comes from DNS discovery, its KV sockets from the discovery's ports;
    ``workers``: with serving.workers: 2."""
    extra: dict = {"sizing": {"tokenizer": str(server.model_dir / "tokenizer.json")}}
    if workers:
        extra["serving"] = _workers_serving()
    if discovered:
        extra["engines"] = {"discovery": "dns", "name": "127.0.0.1", "port": server.port,
                            "kv_events_port": int(server.kv_events.rsplit(":", 1)[1]),
                            "kv_replay_port": int(server.kv_replay.rsplit(":", 1)[1])}
    yield from _pair(server, **extra)
