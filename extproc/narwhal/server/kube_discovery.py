"""Kubernetes discovery: the pool follows the API server, by watch.

``source: endpointslices`` watches the EndpointSlices of a Service (label
``kubernetes.io/service-name``): every ready address is an engine on the slice's port.
``source: inferencepool`` follows an InferencePool (Gateway API Inference Extension) and
the Pods its selector matches: every running, ready Pod is an engine on each of the
pool's target ports; an edit of the pool's selector or ports moves the pool at once (and
the pool's InferenceObjectives are followed too: ``kube_objectives``).
Changes reconcile the pool as DNS discovery does: new endpoints join (eligible after their
first scrape and profile), vanished ones are retired and dropped once drained. A watch
that fails is re-established (re-listing first) after ``interval_ms``; meanwhile the last
known pool stays.

The functions that turn API objects into engine configs are pure (unit-tested); the loop
does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from lightkube import AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.resources.discovery_v1 import EndpointSlice

from ..config import Discovery, EngineConfig
from ..core.router import Router
from .discovery import reconcile
from .kube import as_dict, client, mirror, status_code
from .kube_objectives import follow_objectives

log = logging.getLogger("narwhal.discovery")
SERVICE_LABEL = "kubernetes.io/service-name"
InferencePool = create_namespaced_resource("inference.networking.k8s.io", "v1",
                                           "InferencePool", "inferencepools")


def slice_engines(d: Discovery, obj: dict[str, Any]) -> dict[str, EngineConfig]:
    """Ready endpoints of one EndpointSlice (``conditions.ready`` unset counts as ready,
    as the API documents), on the slice's port named ``port_name`` or its first."""
    ports = [p for p in obj.get("ports") or [] if isinstance(p, dict) and p.get("port")]
    if d.port_name:
        ports = [p for p in ports if p.get("name") == d.port_name]
        if not ports:
            return {}
    port = int(ports[0]["port"]) if ports else d.port
    out = {}
    for ep in obj.get("endpoints") or []:
        if (ep.get("conditions") or {}).get("ready") is False:
            continue
        for ip in ep.get("addresses") or []:
            cfg = d.engine(f"{d.name}/{ip}:{port}", ip, port)
            out[cfg.endpoint] = cfg
    return out


def pool_selector(pool: dict[str, Any]) -> tuple[dict[str, str], list[int]]:
    """An InferencePool's Pod selector and target ports (v1: ``selector.matchLabels`` and
    ``targetPorts[].number``; v1alpha2: a plain ``selector`` map and
    ``targetPortNumber``)."""
    spec = pool.get("spec") or {}
    sel = spec.get("selector") or {}
    labels = sel.get("matchLabels") if isinstance(sel.get("matchLabels"), dict) else sel
    ports = [int(p["number"]) for p in spec.get("targetPorts") or [] if p.get("number")]
    if not ports and spec.get("targetPortNumber"):
        ports = [int(spec["targetPortNumber"])]
    return {str(k): str(v) for k, v in (labels or {}).items()}, ports


def pod_engines(d: Discovery, pod: dict[str, Any], ports: list[int]) -> dict[str, EngineConfig]:
    """A running, ready Pod: one engine per target port (the n-th has its KV-event
    sockets n ports above the configured ones)."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    if not ip or status.get("phase") != "Running" or not ready:
        return {}
    name = (pod.get("metadata") or {}).get("name", ip)
    out = {}
    for rank, port in enumerate(ports):
        cfg = d.engine(f"{name}:{port}", ip, port, rank)
        out[cfg.endpoint] = cfg
    return out


class KubernetesDiscovery:
    """The pool (and, with ``source: inferencepool``, the pool's InferenceObjectives)
    followed from the API server: each by its own list-and-watch, retried on its own
    after ``interval_ms`` when it fails, the last known state kept meanwhile."""

    def __init__(self, router: Router, d: Discovery, api: AsyncClient | None = None) -> None:
        self.router = router
        self.d = d
        self.client = api or client(d.api_server, d.namespace, None)

    def _apply(self, objects: dict[str, dict[str, EngineConfig]]) -> None:
        wanted: dict[str, EngineConfig] = {}
        for engines in objects.values():
            wanted.update(engines)
        reconcile(self.router, wanted, f"{self.d.namespace}/{self.d.name}")

    async def run_once(self) -> None:
        d = self.d
        if d.source == "endpointslices":
            await mirror(self.client, EndpointSlice, d.namespace, {SERVICE_LABEL: d.name},
                         lambda o: slice_engines(d, o), self._apply)
            return
        while True:
            pool = await self.client.get(InferencePool, d.name, namespace=d.namespace)
            selected = pool_selector(as_dict(pool))
            if not selected[0] or not selected[1]:
                raise ValueError(f"InferencePool {d.name} has no selector or no target ports")
            if not await self._pods_until_the_pool_changes(selected):
                return
            log.info("InferencePool %s changed its selector or target ports: following "
                     "the Pods it selects now", d.name)

    async def _pods_until_the_pool_changes(
            self, selected: tuple[dict[str, str], list[int]]) -> bool:
        """Follow the Pods ``selected`` (the pool's selector and target ports) while
        following the pool itself: True once the pool selects otherwise (an edit of its
        selector or ports takes effect at once, not at the next failure of a watch);
        False when a watch ends; a watch's error is raised."""
        d = self.d
        labels, ports = selected
        moved = asyncio.Event()

        def pool_changed(pools: dict[str, tuple[dict[str, str], list[int]]]) -> None:
            now = pools.get(d.name)
            if now is not None and now != selected:
                moved.set()

        tasks = [asyncio.ensure_future(mirror(self.client, Pod, d.namespace, labels,
                                              lambda o: pod_engines(d, o, ports), self._apply)),
                 asyncio.ensure_future(mirror(self.client, InferencePool, d.namespace, None,
                                              pool_selector, pool_changed)),
                 asyncio.ensure_future(moved.wait())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a watch's error ends this follow (the caller lists again)
            return moved.is_set()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _forever(self, what: str, once: Callable[[], Awaitable[None]],
                       keeping: Callable[[], str]) -> None:
        missing = False  # a 404 (no such object or kind) is logged once, not every retry
        while True:
            try:
                await once()
                log.warning("%s ended; re-listing", what)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the last known state; try again
                found = status_code(exc) != 404
                if found:
                    log.warning("%s failed: %r; keeping %s", what, exc, keeping())
                elif not missing:
                    log.warning("%s: not found (404: no such object, or its "
                                "CustomResourceDefinition is not installed); keeping %s, "
                                "trying again every %d ms", what, keeping(), self.d.interval_ms)
                missing = not found
            await asyncio.sleep(self.d.interval_ms / 1000)

    async def run(self) -> None:
        d = self.d
        follows = [self._forever(f"discovery watch on {d.name}", self.run_once,
                                 lambda: f"{len(self.router.engines)} engine(s)")]
        if d.source == "inferencepool" and d.inference_objectives:
            follows.append(self._forever(
                f"InferenceObjective watch for pool {d.name}",
                lambda: follow_objectives(self.router, d, self.client),
                lambda: f"{len(self.router.objectives)} objective(s)"))
        await asyncio.gather(*follows)
