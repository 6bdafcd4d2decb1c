"""The profiling adapter: sends ``core.profiling``'s probes to an engine over HTTP and
feeds the timestamped stream back. One task per engine being profiled; the telemetry
loop starts them and never waits for them (its heartbeat must not depend on an engine)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from ..core.engines import EngineState
from ..core.meter import EngineOutputError
from ..core.profiling import Measurement, Probe, ProbeRun, Profiler
from ..core.router import Router

log = logging.getLogger("narwhal.profiling")
MAX_MODELS_BYTES = 1024 * 1024  # of an engine's /v1/models answer (vLLM's: well under 1 KB)


async def profile_engine(router: Router, engine: EngineState, profiler: Profiler,
                         session: aiohttp.ClientSession) -> None:
    """The probes one after another, each sent once the previous one's first token came:
    prefills never overlap (each TTFT is one probe's, with the earlier probes decoding
    counted as the decodes they are), while the probes' outputs decode together. Sent
    strictly in turn, a re-profile of a loaded engine (drift) kept it out of placement
    for five full outputs at its loaded TPOT."""
    clock = router.clock
    url = engine.config.url.rstrip("/") + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=profiler.timeout_s)
    tasks: list[asyncio.Task[tuple[Measurement, float, int]]] = []
    try:
        probes = profiler.probes(await _max_model_len(engine, session, timeout))
        for probe in probes:
            decoding = sum(1 for t in tasks if not t.done())
            first = asyncio.Event()
            task = asyncio.create_task(_probe(router, engine, session, url, timeout, probe,
                                              decoding, first))
            tasks.append(task)
            waiter = asyncio.create_task(first.wait())
            try:
                await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if task.done():
                task.result()  # a probe that failed before its first token
        router.learning.profile(engine, list(await asyncio.gather(*tasks)))
    except (EngineOutputError, TimeoutError, aiohttp.ClientError, OSError) as exc:
        reason = str(exc) or type(exc).__name__
        profiler.failed(engine, reason, clock())
        log.warning("engine %s failed profiling: %s", engine.name, reason)
    except Exception as exc:  # a bug here must not leave the engine 'profiling' forever
        profiler.failed(engine, f"internal error: {exc!r}", clock())
        log.exception("profiling engine %s", engine.name)
    else:
        profiler.succeeded(engine, clock())
        log.info("engine %s profiled: %.0f prompt tokens/s, TPOT %.1f ms", engine.name,
                 min(engine.model.learned_prefill_tps, 1e9), engine.model.tpot_s(1) * 1000)
    finally:
        for t in tasks:
            t.cancel()
    router.profiled()


async def _probe(router: Router, engine: EngineState, session: aiohttp.ClientSession,
                 url: str, timeout: aiohttp.ClientTimeout, probe: Probe, decoding: int,
                 first: asyncio.Event) -> tuple[Measurement, float, int]:
    """One probe's request and stream; ``first`` is set at its first token. Returns the
    measurement with the model features at its start (work ahead, decodes)."""
    clock = router.clock
    ahead, decodes = engine.prefill_work, engine.decode + decoding
    run = ProbeRun(clock(), engine.token_ids, router.config.serving.max_event_bytes)
    async with session.post(url, data=probe.body, timeout=timeout,
                            headers={"content-type": "application/json"}) as resp:
        if resp.status != 200:
            raise EngineOutputError(f"profile request answered HTTP {resp.status}")
        async for chunk in resp.content.iter_any():
            run.feed(clock(), chunk)
            if run.first is not None:
                first.set()
    return run.finish(probe.tokens), ahead, decodes


async def _max_model_len(engine: EngineState, session: aiohttp.ClientSession,
                         timeout: aiohttp.ClientTimeout) -> int | None:
    """vLLM's model card says how long a prompt may be; other engines may not say."""
    url = engine.config.url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, timeout=timeout) as resp:
            if resp.status != 200:
                return None
            raw = await resp.content.read(MAX_MODELS_BYTES)
        # bounded, and orjson's depth limit: an engine's odd model card costs its prompt
        # size limit, never its profile
        card = orjson.loads(raw)["data"][0]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return None
    value = card.get("max_model_len") if isinstance(card, dict) else None
    return value if value.__class__ is int and value > 48 else None


class Profiling:
    """Starts due profiles; keeps the tasks referenced until they end."""

    def __init__(self, router: Router) -> None:
        cfg = router.config
        self.router = router
        self.profiler = Profiler(cfg.serving.model, router.sizer.bytes_per_token,
                                 cfg.telemetry.profile_timeout_ms / 1000)
        self.tasks: set[asyncio.Task[None]] = set()

    def start_due(self, session: aiohttp.ClientSession) -> None:
        self.profiler.bytes_per_token = self.router.sizer.bytes_per_token
        for engine in self.profiler.due(self.router.engines, self.router.clock()):
            task = asyncio.create_task(profile_engine(self.router, engine, self.profiler,
                                                      session))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
