"""Engine health checks against a real HTTP server: a slow answer is not a "no"."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from narwhal.config import parse
from narwhal.core.router import Router
from narwhal.server.telemetry import scrape_engine


async def _checks(mode: dict[str, str], rounds: list[str]) -> list[bool]:
    """Run one scrape per entry of ``rounds`` (the /health behaviour for that round)."""
    release = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        if mode["health"] == "hang":
            await release.wait()
        return web.Response(status=503 if mode["health"] == "503" else 200)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 1\n")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    router = Router(parse({
        # A "hang" round takes the whole timeout; an "ok" one must never reach it, even on a
        # loaded CI machine (the real-vLLM tier idles alongside): 50 ms was flaky there.
        "telemetry": {"health_timeout_ms": 400, "unhealthy_after_timeouts": 3},
        "engines": [{"name": "e", "url": f"http://127.0.0.1:{port}"}]}))
    engine = router.engines[0]
    seen = []
    try:
        async with aiohttp.ClientSession() as session:
            for behaviour in rounds:
                mode["health"] = behaviour
                await scrape_engine(router, engine, session)
                seen.append(engine.healthy)
    finally:
        release.set()
        await runner.cleanup()
    return seen


def test_timeouts_count_only_in_a_row():
    rounds = ["ok", "hang", "hang", "ok", "hang", "hang", "hang", "ok"]
    assert asyncio.run(_checks({}, rounds)) == [True, True, True, True, True, True, False, True]


def test_an_engine_that_says_no_is_unhealthy_at_once():
    assert asyncio.run(_checks({}, ["ok", "503", "ok"])) == [True, False, True]


def test_a_first_check_that_times_out_is_not_healthy():
    assert asyncio.run(_checks({}, ["hang", "ok"])) == [False, True]
