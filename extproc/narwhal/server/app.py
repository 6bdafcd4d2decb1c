"""`narwhal serve`: the ext_proc gRPC service, gRPC health, admin HTTP, health checks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..config import Config
from ..core.router import Router
from .admin import admin_app
from .extproc import SERVICE_NAME, ExternalProcessor
from .health import health_loop
from .loop import install_uvloop

log = logging.getLogger("narwhal")
HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE_NAME)
DRAIN_TIMEOUT_S = 30.0


def _set_health(servicer: health.aio.HealthServicer, router: Router) -> asyncio.Task:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def loop() -> None:
        last = None
        while True:
            ready = router.not_ready_reason() is None
            if ready != last:
                await servicer.set("liveness", serving)
                for name in ("", "readiness", SERVICE_NAME):
                    await servicer.set(name, serving if ready else not_serving)
                last = ready
            await asyncio.sleep(0.2)

    return asyncio.ensure_future(loop())


async def serve(config: Config) -> None:
    router = Router(config)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 1024 * 1024),
                                      ("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(router), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.serving.host}:{config.serving.extproc_port}"
    server.add_insecure_port(address)
    await server.start()
    runner = web.AppRunner(admin_app(router), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.telemetry.admin_host, config.telemetry.admin_port)
    await site.start()
    tasks = [asyncio.ensure_future(health_loop(router)), _set_health(health_servicer, router)]
    log.info("narwhal serving ext_proc on %s, admin on %s:%d", address,
             config.telemetry.admin_host, config.telemetry.admin_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: refuse new work, let in-flight streams finish, then exit.
    router.draining = True
    deadline = loop.time() + DRAIN_TIMEOUT_S
    while router.accounting.in_flight > 0 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    await server.stop(grace=1.0)
    await runner.cleanup()


def run(config: Config) -> None:
    install_uvloop()
    asyncio.run(serve(config))
