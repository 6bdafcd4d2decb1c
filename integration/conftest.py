"""Real stacks for the integration suite: Envoy + narwhal serve + narwhal sim on loopback."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from narwhal.launch import SimSpec, Stack

MODEL = "narwhal-sim"


# NARWHAL_TEST_WORKERS=N runs every stack with serving.workers: N (test_workers.py runs
# the admission, conservation and reliability suites so, unchanged).
WORKERS = int(os.environ.get("NARWHAL_TEST_WORKERS", "1"))


def _with_workers(config: dict) -> dict:
    serving = dict(config.get("serving", {}))
    if WORKERS <= 1 or serving.get("transport", "asyncio") != "asyncio":
        return config
    serving.setdefault("extproc_socket", unix_socket())
    serving.setdefault("workers", WORKERS)
    return {**config, "serving": serving}


def _stack(sims: list[SimSpec], config: dict | None = None,
           engine_seed: dict | None = None) -> Iterator[Stack]:
    stack = Stack(sims=sims, config=_with_workers(config or {}), model=MODEL,
                  engine_seed=engine_seed or {})
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def unix_socket() -> str:
    """A fresh path for serving.extproc_socket (short: a socket path has 108 bytes)."""
    return str(Path(tempfile.mkdtemp(prefix="nw-")) / "extproc.sock")


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """One vLLM-dialect engine, so every request lands on it. Envoy reaches Narwhal over
    a Unix socket, as in the chart's sidecar mode (the TCP port still serves gRPC health
    and the tests that speak ext_proc directly); most other stacks use loopback TCP."""
    yield from _stack([SimSpec("sim-a")], {"serving": {"max_request_bytes": 65536,
                                                       "extproc_socket": unix_socket()}})


@pytest.fixture(scope="session")
def reasoning_stack() -> Iterator[Stack]:
    yield from _stack([SimSpec("sim-r", args=["--reasoning", "both"])])


@pytest.fixture(scope="session")
def openai_stack() -> Iterator[Stack]:
    yield from _stack([SimSpec("sim-o", dialect="openai")])


def client_for(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0,
                         timeout=30)


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return client_for(stack)


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c


def status(stack: Stack) -> dict:
    return httpx.get(f"{stack.admin_url}/status", timeout=5).json()


def wait_for(what: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll an observable condition (a status field, a Lease, /ready) until it holds;
    return its value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = what()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {getattr(what, '__name__', what)}")
