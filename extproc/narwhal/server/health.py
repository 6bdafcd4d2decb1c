"""Engine health checks: GET /health on every engine, on a fixed interval."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from ..core.router import Router

log = logging.getLogger("narwhal.health")


async def check_once(router: Router, session: aiohttp.ClientSession) -> None:
    timeout = aiohttp.ClientTimeout(total=router.config.telemetry.health_timeout_ms / 1000)

    async def one(engine) -> None:
        try:
            async with session.get(engine.config.url.rstrip("/") + "/health",
                                   timeout=timeout) as resp:
                ok = resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            ok = False
        if ok != engine.healthy or not engine.checked:
            log.info("engine %s is %s", engine.name, "healthy" if ok else "unhealthy")
        engine.healthy = ok
        engine.checked = True

    await asyncio.gather(*(one(e) for e in router.pool.engines))
    router.changed()


async def health_loop(router: Router) -> None:
    interval = router.config.telemetry.health_interval_ms / 1000
    async with aiohttp.ClientSession() as session:
        while True:
            await check_once(router, session)
            await asyncio.sleep(interval)
