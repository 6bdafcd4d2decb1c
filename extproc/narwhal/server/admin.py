"""Admin HTTP on its own port (never the client port): /ready /live /metrics /status,
and the operator API under /admin (maintenance waves, fencing).

Reads are open (probes and scrapers need them). Mutations can put every client on 503,
so they need ``Authorization: Bearer <telemetry.admin_token>`` and, when they carry a
body, ``content-type: application/json`` (which no cross-site "simple request" can
send); with no token configured they are refused outright.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    ProcessCollector,
    generate_latest,
)

from .. import __version__
from ..config import ConfigError, Telemetry
from ..core.router import Router
from .metrics import RouterCollector, WorkersCollector


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=orjson.dumps({"error": message}).decode(),
                              content_type="application/json")


def admin_token(cfg: Telemetry) -> str | None:
    """The configured admin token, read from its file or environment variable if so given."""
    if cfg.admin_token_file:
        try:
            token = Path(cfg.admin_token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"telemetry.admin_token_file: cannot read "
                              f"{cfg.admin_token_file}: {exc.strerror}") from exc
    elif cfg.admin_token_env:
        token = os.environ.get(cfg.admin_token_env, "").strip()
        if not token:
            raise ConfigError(f"telemetry.admin_token_env: {cfg.admin_token_env} is not set")
    else:
        token = cfg.admin_token
    return token or None


def _refusal(status: int, message: str, **headers: str) -> web.HTTPException:
    cls = {401: web.HTTPUnauthorized, 403: web.HTTPForbidden,
           415: web.HTTPUnsupportedMediaType}[status]
    return cls(text=orjson.dumps({"error": message}).decode(), content_type="application/json",
               headers=headers)


def _guard(token: str | None):
    @web.middleware
    async def guard(request: web.Request, handler):
        if request.path.startswith("/admin/"):
            if token is None:
                raise _refusal(403, "admin mutations are disabled: set telemetry.admin_token")
            given = request.headers.get("authorization", "")
            scheme, _, credential = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    credential.strip().encode(), token.encode()):
                raise _refusal(401, "admin mutations need a valid bearer token",
                               **{"WWW-Authenticate": 'Bearer realm="narwhal-admin"'})
            if request.can_read_body and request.content_type != "application/json":
                raise _refusal(415, "admin request bodies must be application/json")
        return await handler(request)
    return guard


def admin_app(router: Router, token: str | None = None,
              workers: Callable[[], list[dict[str, Any]]] | None = None,
              refresh: Callable[[], Awaitable[None]] | None = None) -> web.Application:
    """``workers``: the worker processes' state for /status and /metrics
    (``serving.workers``); ``refresh``, awaited before either answers: their figures
    that only they can tell (their collectors' totals), asked for fresh."""
    registry = CollectorRegistry()
    registry.register(RouterCollector(router))
    # This process's own: CPU, resident memory (beside narwhal_held_bytes, what the
    # budget counts), open files, and what the cyclic garbage collector found.
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    if workers is not None:
        registry.register(WorkersCollector(workers))

    async def ready(request: web.Request) -> web.Response:
        reason = router.not_ready_reason()
        if reason is None:
            return _json({"ready": True})
        return _json({"ready": False, "reason": reason}, status=503)

    async def live(request: web.Request) -> web.Response:
        if router.live():
            return _json({"live": True})
        return _json({"live": False, "reason": "telemetry loop stalled"}, status=503)

    async def metrics(request: web.Request) -> web.Response:
        if refresh is not None:
            await refresh()
        return web.Response(body=generate_latest(registry),
                            headers={"content-type": CONTENT_TYPE_LATEST})

    async def status(request: web.Request) -> web.Response:
        if refresh is not None:
            await refresh()
        acct = router.accounting
        now = router.clock()
        stale = router.pool.stale_after_s
        return _json({
            "version": __version__,
            "model": router.config.serving.model,
            "role": router.config.router.role,
            "admission_mode": router.config.admission.mode,
            "objectives": router.objectives,
            "ready": router.not_ready_reason() is None,
            "reason": router.not_ready_reason(),
            "requests": {"offered": acct.offered, "unsized_offered": acct.unsized_offered,
                         "in_flight": acct.in_flight, "held": router.held,
                         "held_bytes": router.held_bytes,
                         "queued": len(router.scheduler.queue),
                         "queued_by_priority": {str(p): n for p, n in sorted(
                             router.scheduler.queued_by_priority().items(), reverse=True)},
                         "queued_flows": router.scheduler.queued_flows(),
                         "queue_gave_up": router.scheduler.gave_up,
                         "terminal": acct.terminal},
            "workers": workers() if workers is not None else [],
            "sizing": {"bytes_per_token": round(router.sizer.bytes_per_token, 3),
                       "samples": router.sizer.samples},
            "prediction_error": router.learning.error_quantiles(),
            "output_length_error": router.learning.outputs.error_summary(),
            "engines": [{"name": e.name, "url": e.config.url, "endpoint": e.endpoint,
                         "dialect": e.config.dialect, "healthy": e.healthy,
                         "telemetry_fresh": e.fresh(now, stale), "maintenance": e.maintenance,
                         "eligible": e.serviceable(now, stale),
                         "in_flight": e.in_flight, "prefill": e.prefill, "decode": e.decode,
                         "prefill_work": round(e.prefill_work),
                         "prediction_error": e.prediction_errors.summary(),
                         "verified_work": round(e.verified_work),
                         "running": e.running, "waiting": e.waiting,
                         "kv_cache_usage": e.kv_cache_usage,
                         "prefill_tps": _finite(round(e.model.learned_prefill_tps, 1)),
                         "ttft_fit": e.model.ttft_fit(),
                         "tpot_ms": round(e.model.tpot_s(e.decode) * 1000, 3),
                         "step_ms": round(e.model.step_s * 1000, 3),
                         "live_steps": e.model.live_steps,
                         "step_model": e.model.step_model.summary(),
                         "prefix_hit_rate": round(e.model.hit_rate, 4),
                         "predicted_hit_rate": round(e.predicted_hit_rate, 4),
                         "prefix_index_blocks": len(e.prefix.blocks),
                         "prefix_index_capacity": e.prefix.capacity,
                         "index_tokens": round(e.index_tokens),
                         "index_cached_tokens": round(e.index_cached_tokens),
                         "kv_capacity_tokens": e.kv_capacity_tokens,
                         "prefix_index_evictions": e.prefix.evictions,
                         "prefix_source": ("kv-events" if e.kv is not None and e.kv.live(now)
                                           else "index"),
                         "kv_events": None if e.kv is None else {
                             "blocks": len(e.kv.by_engine), "block_size": e.kv.block_size,
                             "batches": e.kv.batches, "errors": e.kv.errors,
                             "unchained": e.kv.unchained, "live": e.kv.live(now),
                             "complete": e.kv.complete, "replayed": e.kv.replayed,
                             "keyed": e.kv.keyed},
                         "model_samples": e.model.samples,
                         "profiled": e.profiled, "profiling": e.profiling,
                         "profiles": e.profiles, "profile_failures": e.profile_failures,
                         "profile_error": e.profile_error,
                         "calibration": round(e.calibration.overall, 4),
                         "calibration_octaves": e.calibration.octaves(),
                         "idle_calibration": round(e.idle_calibration.overall, 4),
                         "idle_calibration_octaves": e.idle_calibration.octaves(),
                         "drift": round(e.model.drift, 4),
                         "drift_resets": e.model.drift_resets,
                         "dispatched": e.dispatched, "failovers": e.failovers,
                         "completed": e.completed,
                         "output_tokens": e.output_tokens,
                         "measurement_failures": e.measurement_failures,
                         "token_accounting": e.token_accounting}
                        for e in router.engines],
        })

    async def _selection(request: web.Request) -> list:
        try:
            # orjson: its depth limit makes a deeply nested body a 400 (the stdlib's
            # recursion error was a 500)
            body = orjson.loads(await request.read()) if request.can_read_body else {}
        except orjson.JSONDecodeError:
            raise _bad_request("body must be JSON") from None
        if not isinstance(body, dict):
            body = {}
        if body.get("all") is True:
            return list(router.engines)
        names = body.get("engines")
        if not isinstance(names, list) or not names:
            raise _bad_request('give {"engines": [names]} or {"all": true}')
        engines = []
        for name in names:
            engine = router.engine(name) if isinstance(name, str) else None
            if engine is None:
                raise _bad_request(f"unknown engine {name!r}")
            engines.append(engine)
        return engines

    async def maintenance(request: web.Request) -> web.Response:
        router.set_maintenance(await _selection(request), request.method == "POST")
        return _json({"maintenance": [e.name for e in router.engines if e.maintenance]})

    async def fence(request: web.Request) -> web.Response:
        router.set_fenced(request.method == "POST")
        return _json({"fenced": router.fenced})

    app = web.Application(middlewares=[_guard(token)], client_max_size=65536)
    app.router.add_get("/ready", ready)
    app.router.add_get("/live", live)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    app.router.add_post("/admin/maintenance", maintenance)
    app.router.add_delete("/admin/maintenance", maintenance)
    app.router.add_post("/admin/fence", fence)
    app.router.add_delete("/admin/fence", fence)
    return app


def _finite(x: float) -> float | None:
    return x if x != float("inf") else None
