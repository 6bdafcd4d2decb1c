"""Admin HTTP on its own port (never the client port): /ready /live /metrics /status."""

from __future__ import annotations

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .. import __version__
from ..core.router import Router
from .metrics import RouterCollector


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def admin_app(router: Router) -> web.Application:
    registry = CollectorRegistry()
    registry.register(RouterCollector(router))

    async def ready(request: web.Request) -> web.Response:
        reason = router.not_ready_reason()
        if reason is None:
            return _json({"ready": True})
        return _json({"ready": False, "reason": reason}, status=503)

    async def live(request: web.Request) -> web.Response:
        return _json({"live": True})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"content-type": CONTENT_TYPE_LATEST})

    async def status(request: web.Request) -> web.Response:
        acct = router.accounting
        return _json({
            "version": __version__,
            "model": router.config.serving.model,
            "role": router.config.router.role,
            "ready": router.not_ready_reason() is None,
            "reason": router.not_ready_reason(),
            "requests": {"offered": acct.offered, "unsized_offered": acct.unsized_offered,
                         "in_flight": acct.in_flight, "terminal": acct.terminal},
            "engines": [{"name": e.name, "url": e.config.url, "endpoint": e.endpoint,
                         "dialect": e.config.dialect, "healthy": e.healthy,
                         "in_flight": e.in_flight, "completed": e.completed,
                         "output_tokens": e.output_tokens,
                         "measurement_failures": e.measurement_failures,
                         "token_accounting": e.token_accounting}
                        for e in router.pool.engines],
        })

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_get("/live", live)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    return app
