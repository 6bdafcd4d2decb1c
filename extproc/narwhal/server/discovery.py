"""DNS discovery: resolve a headless Service name on an interval; the records are the pool.

New addresses join (unchecked, so not placement-eligible until their first telemetry
scrape); addresses that disappear are retired: no new work, dropped once drained.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from ..config import Discovery, EngineConfig
from ..core.router import Router
from .loop import joined

log = logging.getLogger("narwhal.discovery")


def engine_configs(d: Discovery, addresses: set[str]) -> dict[str, EngineConfig]:
    out = {}
    for ip in sorted(addresses):
        cfg = d.engine(f"{d.name}/{ip}", ip, d.port)
        out[cfg.endpoint] = cfg
    return out


async def resolve(name: str, port: int) -> set[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return {info[4][0] for info in infos}


async def discover_once(router: Router, d: Discovery) -> None:
    try:
        addresses = await resolve(d.name, d.port)
    except OSError as exc:  # keep the last known pool when DNS fails
        log.warning("cannot resolve %s: %s; keeping %d engine(s)", d.name, exc,
                    len(router.engines))
        return
    reconcile(router, engine_configs(d, addresses), d.name)


def reconcile(router: Router, wanted: dict[str, EngineConfig], source: str) -> None:
    """The pool becomes ``wanted`` (what DNS or the Kubernetes API says, by endpoint):
    engines that joined are frozen out of the cyclic collector's sight (``loop.joined``),
    and the router is told, so that queued work can move."""
    added, retired = router.pool.reconcile(wanted)
    if added:
        joined()
    if added or retired:
        log.info("discovery %s: added %s, retired %s", source, added, retired)
        router.changed()


async def discovery_loop(router: Router, d: Discovery) -> None:
    while True:
        await discover_once(router, d)
        await asyncio.sleep(d.interval_ms / 1000)
