"""`narwhal serve`: the ext_proc gRPC service, gRPC health, admin HTTP, health checks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2_grpc

from ..config import Config, ConfigError, Serving
from ..core.router import Router
from .access_log import ACCESS_LOG_PATH, AccessLogCall
from .admin import admin_app, admin_token
from .discovery import discover_once, discovery_loop
from .driver import RECORDS, Runtime, in_thread
from .extproc import PROCESS_PATH, ExternalProcessor, ExtProcCall
from .grpc_health import (
    CHECK_PATH,
    READINESS_SERVICES,
    WATCH_PATH,
    HealthRegistry,
    serving_status,
)
from .grpc_server import Call, GrpcConnection, Stream, StreamBudget
from .loop import install_uvloop, started
from .telemetry import telemetry_loop

if TYPE_CHECKING:
    from .tracing import Tracer

log = logging.getLogger("narwhal")
DRAIN_TIMEOUT_S = 30.0


def health_status(router: Router, service: str) -> int | None:
    return serving_status(service, router.not_ready_reason)


def _unlink_stale(path: str) -> None:
    """A socket file left by a previous process would make bind fail; anything else at
    that path is not ours to remove."""
    p = Path(path)
    if p.is_socket():
        p.unlink()
    elif p.exists():
        raise ConfigError(f"serving.extproc_socket: {path} exists and is not a socket")


async def listen_grpc(serving: Serving, routes: dict[bytes, Callable[[Stream], Call]],
                      port: int | None, socket_path: str) -> Callable[[], Awaitable[None]]:
    """Serve gRPC ``routes`` on ``serving.host:port`` (None: no TCP) and the Unix socket
    ``socket_path`` ("" none), within ``serving``'s connection bounds; returns stop."""
    connections: set[GrpcConnection] = set()
    budget = StreamBudget(serving.max_streams)

    def factory() -> GrpcConnection:
        full = len(connections) >= serving.max_connections
        if full:
            log.warning("refusing an ext_proc connection: serving.max_connections (%d) reached",
                        serving.max_connections)
        conn = GrpcConnection(routes, max_message=serving.max_message_bytes,
                              on_lost=connections.discard,
                              preface_timeout=serving.preface_timeout_ms / 1000, refuse=full,
                              budget=budget)
        if not full:
            connections.add(conn)
        return conn

    loop = asyncio.get_running_loop()
    servers = []
    if port is not None:
        servers.append(await loop.create_server(factory, serving.host, port))
    if socket_path:
        _unlink_stale(socket_path)
        servers.append(await loop.create_unix_server(factory, socket_path))

    async def stop() -> None:
        for server in servers:
            server.close()
        for conn in list(connections):
            if conn.transport is not None:
                conn.transport.close()
        for server in servers:
            await server.wait_closed()

    return stop


async def _start_asyncio(config: Config, runtime: Runtime) -> Callable[[], Awaitable[None]]:
    router = runtime.router
    registry = HealthRegistry(functools.partial(health_status, router))
    router.listeners.append(registry.refresh)
    routes: dict[bytes, Callable[[Stream], Call]] = {
        PROCESS_PATH: functools.partial(ExtProcCall, runtime),
        CHECK_PATH: registry.check_call, WATCH_PATH: registry.watch_call,
        ACCESS_LOG_PATH: functools.partial(AccessLogCall, router.closes.logged)}
    return await listen_grpc(config.serving, routes, config.serving.extproc_port,
                             config.serving.extproc_socket)


async def _start_grpcio(config: Config, runtime: Runtime) -> Callable[[], Awaitable[None]]:
    router = runtime.router
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", config.serving.max_message_bytes),
                                      ("grpc.so_reuseport", 0)],
                             maximum_concurrent_rpcs=config.serving.max_streams)
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(runtime), server)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"{config.serving.host}:{config.serving.extproc_port}")
    if config.serving.extproc_socket:
        _unlink_stale(config.serving.extproc_socket)
        server.add_insecure_port(f"unix:{config.serving.extproc_socket}")
    await server.start()

    def mirror() -> None:
        for name in ("liveness", *READINESS_SERVICES):
            asyncio.ensure_future(servicer.set(name, health_status(router, name)))

    mirror()
    router.listeners.append(mirror)
    return functools.partial(server.stop, grace=1.0)


def start_tracer(config: Config) -> Tracer | None:
    """With tracing on, a span per finished exchange (in whichever process drove it)."""
    if not config.telemetry.tracing.enabled:
        return None
    try:
        from .tracing import Tracer  # the OpenTelemetry SDK only where tracing is on
    except ImportError as exc:
        raise ConfigError(
            f"telemetry.tracing: the OTLP exporter cannot load ({exc}); if xds-protos "
            "overwrote opentelemetry-proto's files, run scripts/restore_otel_protos.py "
            "or: pip install --force-reinstall --no-deps opentelemetry-proto") from exc
    tracer = Tracer(config.telemetry.tracing)
    RECORDS.append(tracer)
    return tracer


def stop_tracer(tracer: Tracer | None) -> None:
    if tracer is not None:  # flushes what is batched
        RECORDS.remove(tracer)
        tracer.shutdown()


async def serve(config: Config, config_path: str | None = None) -> None:
    """``config_path``: where ``config`` was read, for worker processes to read it too."""
    token = admin_token(config.telemetry)  # a missing file or variable fails start-up
    router = Router(config)
    loop = asyncio.get_running_loop()
    runtime = Runtime(router, loop, in_thread(loop))
    start = _start_asyncio if config.serving.transport == "asyncio" else _start_grpcio
    stop_grpc = await start(config, runtime)
    workers = None
    if config.serving.workers > 1:
        if config_path is None:
            raise ConfigError("serving.workers: worker processes read the configuration "
                              "file; start with narwhal serve --config")
        from .workers import Workers

        workers = Workers(runtime, config_path)
        await workers.start()  # every worker listening before /ready can say yes
    runner = web.AppRunner(admin_app(router, token, workers and workers.status,
                                     workers and workers.refresh_stats), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.telemetry.admin_host, config.telemetry.admin_port)
    await site.start()
    tasks = []
    if config.discovery is not None and config.discovery.discovery == "kubernetes":
        from .kube_discovery import KubernetesDiscovery

        tasks.append(asyncio.ensure_future(KubernetesDiscovery(router, config.discovery).run()))
    elif config.discovery is not None:
        await discover_once(router, config.discovery)  # the pool exists before telemetry
        tasks.append(asyncio.ensure_future(discovery_loop(router, config.discovery)))
    tasks.append(asyncio.ensure_future(telemetry_loop(router)))
    subscribers = None
    if config.kv_events:
        from .kv_events import KvSubscribers  # pyzmq only where engines publish events

        subscribers = KvSubscribers(router)
        subscribers.sync()
        router.listeners.append(subscribers.sync)  # discovered engines join and leave
    tracer = start_tracer(config)
    lease = None
    if router.leadership is not None:
        from .leader import LeaseLoop  # lightkube only where leader election is on

        lease = LeaseLoop(router)
        tasks.append(asyncio.ensure_future(lease.run()))
    log.info("narwhal serving ext_proc (%s) on %s:%d, admin on %s:%d", config.serving.transport,
             config.serving.host, config.serving.extproc_port, config.telemetry.admin_host,
             config.telemetry.admin_port)
    log.debug("start-up's %d objects frozen", started())
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: refuse new work, hand the lease over (a standby takes it at once instead of
    # after expiry), let in-flight streams finish, then exit.
    router.start_draining()
    if lease is not None:
        tasks[-1].cancel()
        await lease.release()
    deadline = loop.time() + DRAIN_TIMEOUT_S
    while router.accounting.in_flight > 0 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if subscribers is not None:
        router.listeners.remove(subscribers.sync)
        tasks += subscribers.cancel()
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    if workers is not None:
        await workers.stop()
    await stop_grpc()
    await runner.cleanup()
    stop_tracer(tracer)


def run(config: Config, config_path: str | None = None) -> None:
    install_uvloop()
    asyncio.run(serve(config, config_path))
