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
import math
import re

import aiohttp

from ..core.engines import EngineState
from ..core.pool import Scrape
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
# The lines read, found by the regex engine: vLLM's /metrics is mostly histogram buckets
# Narwhal does not read, scraped from every engine every health interval, so a loop over
# every line in Python cost the data path (measured: a line loop over 4 MiB took 99-288 ms).
# A literal start (a newline, then "vllm:") lets it skip ahead by string search: 4-6x
# faster than a multi-line "^" tried at every line.
_SERIES = re.compile(r"\n(vllm:(?:" + "|".join(
    re.escape(n.removeprefix("vllm:")) for n in (*GAUGES, CACHE_INFO)) + r"))[{ ][^\n]*")
# At most this many of those lines are read: vLLM writes one per model and engine index,
# and past it a hostile body's thousands of matching lines are ignored, not each parsed.
MAX_SERIES = 1024


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum the series Narwhal reads across label sets; ignore everything else. The cache
    configuration's info gauge gives ``kv_capacity_tokens`` (block size x GPU blocks)."""
    out: dict[str, float] = {}
    for n, match in enumerate(_SERIES.finditer("\n" + text)):
        if n == MAX_SERIES:
            break
        name, line = match.group(1), match.group(0)[1:]
        if name == CACHE_INFO:
            labels = dict(_LABEL.findall(line[:4096]))
            size, blocks = labels.get("block_size", ""), labels.get("num_gpu_blocks", "")
            if size.isdecimal() and blocks.isdecimal() and len(size + blocks) < 20:
                out["kv_capacity_tokens"] = out.get("kv_capacity_tokens", 0.0) + int(size) * int(
                    blocks)
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        # Every series read here is a count or a share: a NaN, an infinity or a negative
        # value is an engine's bug, and taken as is it would do lasting harm (a NaN KV
        # usage fails the kv-headroom filter; one NaN counter makes every later delta of
        # the hit rate NaN, so it never learns again).
        if not 0.0 <= value < math.inf:
            continue
        attr = GAUGES[name]
        out[attr] = out.get(attr, 0.0) + value
    return out


async def scrape(router: Router, engine: EngineState, session: aiohttp.ClientSession) -> Scrape:
    """One health check: /health, then /metrics while healthy. HTTP only; what it means
    is the pool's to decide (``Pool.observe``)."""
    timeout = aiohttp.ClientTimeout(total=router.config.telemetry.health_timeout_ms / 1000)
    base = engine.config.url.rstrip("/")
    try:
        async with session.get(base + "/health", timeout=timeout) as resp:
            if resp.status != 200:
                return Scrape()
        async with session.get(base + "/metrics", timeout=timeout) as resp:
            if resp.status == 200:
                text = (await resp.content.read(MAX_METRICS_BYTES)).decode("utf-8", "replace")
                return Scrape(healthy=True, metrics=parse_vllm_metrics(text))
            return Scrape(healthy=True, no_metrics=resp.status == 404)
    except TimeoutError:
        return Scrape(timed_out=True)
    except (aiohttp.ClientError, OSError):
        return Scrape(unreachable=True)


async def scrape_engine(router: Router, engine: EngineState,
                        session: aiohttp.ClientSession) -> None:
    result = await scrape(router, engine, session)
    if router.pool.observe(engine, result, router.clock(), router.sizer.tokens_per_block()):
        log.info("engine %s is %s", engine.name, "healthy" if engine.healthy else "unhealthy")


async def check_once(router: Router, session: aiohttp.ClientSession,
                     profiling: Profiling | None = None) -> None:
    await asyncio.gather(*(scrape_engine(router, e, session) for e in list(router.engines)))
    if profiling is not None:
        profiling.start_due(session)
    router.round_done()  # an engine that came back can take queued work


async def telemetry_loop(router: Router) -> None:
    """Health rounds forever. A round that fails is logged and the loop goes on; each
    round that completes is a heartbeat, and ``/live`` turns red when heartbeats stop
    (a loop that keeps failing, or one that died), so that a liveness probe restarts
    the router instead of leaving it refusing everything as monitoring-degraded."""
    interval = router.config.telemetry.health_interval_ms / 1000
    router.heartbeat = router.clock()  # the loop is alive from its start
    profiling = Profiling(router) if router.config.telemetry.profiling else None
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                await check_once(router, session, profiling)  # a heartbeat when it completes
            except Exception:
                log.exception("telemetry round failed")
            await asyncio.sleep(interval)
