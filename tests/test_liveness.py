"""Background telemetry survives its own failures, and /live tells when it cannot."""

from __future__ import annotations

import asyncio

import pytest

from narwhal.config import parse
from narwhal.core.router import Router
from narwhal.server import telemetry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_live_turns_red_when_heartbeats_stop():
    clock = Clock()
    router = Router(parse({"telemetry": {"health_interval_ms": 1000, "stale_after_ms": 5000}}),
                    clock=clock)
    assert router.live()  # no loop yet
    router.heartbeat = clock.now
    clock.now += 5.0
    assert router.live()
    clock.now += 0.5
    assert not router.live()


def test_failing_rounds_are_survived(monkeypatch):
    router = Router(parse({"telemetry": {"health_interval_ms": 1}}))
    calls = []

    async def flaky(r, session, profiling=None):
        calls.append(len(calls))
        if len(calls) <= 3:
            raise RuntimeError("round failed")
        if len(calls) == 5:
            raise asyncio.CancelledError

    monkeypatch.setattr(telemetry, "check_once", flaky)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(telemetry.telemetry_loop(router))
    assert len(calls) == 5  # the loop went on after three failed rounds
    assert router.heartbeat is not None and router.live()


def test_the_ext_proc_service_name_is_a_readiness_name():
    from narwhal.server.extproc import SERVICE_NAME
    from narwhal.server.grpc_health import READINESS_SERVICES

    assert SERVICE_NAME in READINESS_SERVICES
