"""Engine telemetry: /health and vLLM's /metrics on every engine, on a fixed interval.

An engine whose last good scrape is older than ``telemetry.stale_after_ms`` is not
placement-eligible; when every engine is stale the router is monitoring-degraded.
Engines without a /metrics route (404) count as fresh on a passing health check.
A check that times out counts against an engine only after
``telemetry.unhealthy_after_timeouts`` in a row (a busy engine is slow, not down).
"""

from __future__ import annotations

import asyncio
import logging
import re

import aiohttp

from ..core.engines import EngineState
from ..core.profiling import reprofile
from ..core.router import Router
from .profiling import Profiling

log = logging.getLogger("narwhal.telemetry")
GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
          "vllm:kv_cache_usage_perc": "kv_cache_usage",
          "vllm:prefix_cache_queries_total": "prefix_queries",
          "vllm:prefix_cache_hits_total": "prefix_hits"}
MAX_METRICS_BYTES = 4 * 1024 * 1024


CACHE_INFO = "vllm:cache_config_info"
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum the series Narwhal reads across label sets; ignore everything else. The cache
    configuration's info gauge gives ``kv_capacity_tokens`` (block size x GPU blocks)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == CACHE_INFO:
            labels = dict(_LABEL.findall(line[:4096]))
            size, blocks = labels.get("block_size", ""), labels.get("num_gpu_blocks", "")
            if size.isdecimal() and blocks.isdecimal() and len(size + blocks) < 20:
                out["kv_capacity_tokens"] = out.get("kv_capacity_tokens", 0.0) + int(size) * int(
                    blocks)
            continue
        attr = GAUGES.get(name)
        if attr is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        out[attr] = out.get(attr, 0.0) + value
    return out


async def scrape_engine(router: Router, engine: EngineState,
                        session: aiohttp.ClientSession) -> None:
    timeout = aiohttp.ClientTimeout(total=router.config.telemetry.health_timeout_ms / 1000)
    base = engine.config.url.rstrip("/")
    try:
        async with session.get(base + "/health", timeout=timeout) as resp:
            ok = resp.status == 200
        fresh = False
        if ok:
            async with session.get(base + "/metrics", timeout=timeout) as resp:
                if resp.status == 200:
                    text = (await resp.content.read(MAX_METRICS_BYTES)).decode("utf-8", "replace")
                    values = parse_vllm_metrics(text)
                    for attr in ("running", "waiting", "kv_cache_usage"):
                        if attr in values:
                            setattr(engine, attr, values[attr])
                    if "kv_capacity_tokens" in values:
                        router.pool.observe_kv_capacity(engine, values["kv_capacity_tokens"],
                                                        router.sizer.tokens_per_block())
                    if "prefix_queries" in values and "prefix_hits" in values:
                        engine.model.observe_cache(values["prefix_queries"],
                                                   values["prefix_hits"])
                    fresh = True
                else:
                    fresh = resp.status == 404
    except TimeoutError:
        engine.health_timeouts += 1
        limit = router.config.telemetry.unhealthy_after_timeouts
        ok, fresh = engine.healthy and engine.health_timeouts < limit, False
    except (aiohttp.ClientError, OSError):
        ok = fresh = False
    else:
        engine.health_timeouts = 0
    if ok != engine.healthy or not engine.checked:
        log.info("engine %s is %s", engine.name, "healthy" if ok else "unhealthy")
        if ok and engine.checked:
            engine.prefix.clear()  # it may have restarted: its prefix cache is gone
            if router.config.telemetry.profiling:
                reprofile(engine)  # it came back: measure it again before it takes work
    engine.healthy = ok
    engine.checked = True
    if fresh:
        engine.telemetry_at = router.clock()


async def check_once(router: Router, session: aiohttp.ClientSession,
                     profiling: Profiling | None = None) -> None:
    await asyncio.gather(*(scrape_engine(router, e, session) for e in list(router.engines)))
    if profiling is not None:
        profiling.start_due(session)
    router.started = True
    router.changed()
    router.pump()  # an engine that came back can take queued work


async def telemetry_loop(router: Router) -> None:
    """Health rounds forever. A round that fails is logged and the loop goes on; each
    round that completes is a heartbeat, and ``/live`` turns red when heartbeats stop
    (a loop that keeps failing, or one that died), so that a liveness probe restarts
    the router instead of leaving it refusing everything as monitoring-degraded."""
    interval = router.config.telemetry.health_interval_ms / 1000
    router.heartbeat = router.clock()
    profiling = Profiling(router) if router.config.telemetry.profiling else None
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                await check_once(router, session, profiling)
                router.heartbeat = router.clock()
            except Exception:
                log.exception("telemetry round failed")
            await asyncio.sleep(interval)
