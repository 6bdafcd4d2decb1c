"""Engines that join after start-up are frozen out of the cyclic collector's sight, as
start-up's pool is (``server/loop.py``): a full collection walked every entry of every
discovered engine's prefix index (an OrderedDict of up to 65,536 block hashes each)."""

from __future__ import annotations

import asyncio
import gc

from narwhal.config import parse
from narwhal.core.router import Router
from narwhal.server.discovery import discover_once
from narwhal.server.kube_discovery import KubernetesDiscovery
from narwhal.server.loop import started


def walked_by_a_collection(obj: object) -> bool:
    """Whether a collection of any generation visits ``obj`` (frozen objects are in none)."""
    return any(o is obj for o in gc.get_objects())


def test_engines_found_by_dns_after_start_up_are_frozen():
    async def go() -> None:
        config = parse({"engines": {"discovery": "dns", "name": "localhost", "port": 8000}})
        router = Router(config)
        started()
        await discover_once(router, config.discovery)
        e = next(e for e in router.engines if e.name == "localhost/127.0.0.1")
        assert not walked_by_a_collection(e.prefix.blocks)
        e.prefix.insert([hash(("block", i)) for i in range(10_000)])  # what serving adds
        assert not walked_by_a_collection(e.prefix.blocks)
    try:
        asyncio.run(go())
    finally:
        gc.unfreeze()


def test_engines_a_kubernetes_watch_adds_are_frozen():
    config = parse({"engines": {"discovery": "kubernetes", "name": "pool",
                                "source": "endpointslices"}})
    router = Router(config)
    try:
        started()
        d = config.discovery
        discovery = KubernetesDiscovery(router, d, api=object())  # no API calls here
        discovery._apply({"slice": {"10.0.0.7:8000": d.engine("pool/10.0.0.7", "10.0.0.7",
                                                              8000)}})
        e = next(e for e in router.engines if e.endpoint == "10.0.0.7:8000")
        assert not walked_by_a_collection(e.prefix.blocks)
    finally:
        gc.unfreeze()
