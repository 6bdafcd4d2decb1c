"""Kubernetes discovery: the pool follows the API server, by watch.

``source: endpointslices`` watches the EndpointSlices of a Service (label
``kubernetes.io/service-name``): every ready address is an engine on the slice's port.
``source: inferencepool`` reads an InferencePool (Gateway API Inference Extension) and
watches the Pods its selector matches: every running, ready Pod is an engine on each of
the pool's target ports. Changes reconcile the pool as DNS discovery does: new endpoints
join (eligible after their first scrape and profile), vanished ones are retired and
dropped once drained. A watch that fails is re-established (re-listing first) after
``interval_ms``; meanwhile the last known pool stays.

The functions that turn API objects into engine configs are pure (unit-tested); the loop
does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from lightkube import AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.resources.discovery_v1 import EndpointSlice

from ..config import Discovery, EngineConfig
from ..core.router import Router
from .discovery import reconcile
from .kube import client

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
    def __init__(self, router: Router, d: Discovery, api: AsyncClient | None = None) -> None:
        self.router = router
        self.d = d
        self.client = api or client(d.api_server, d.namespace, None)
        self.objects: dict[str, dict[str, EngineConfig]] = {}  # object name -> its engines

    def _apply(self) -> None:
        wanted: dict[str, EngineConfig] = {}
        for engines in self.objects.values():
            wanted.update(engines)
        reconcile(self.router, wanted, f"{self.d.namespace}/{self.d.name}")

    async def _watch(self, resource: Any, labels: dict[str, str], engines) -> None:
        # A fresh watch (no resourceVersion) starts with the current objects, each ADDED.
        self.objects.clear()
        async for op, obj in self.client.watch(resource, namespace=self.d.namespace,
                                               labels=labels):
            data = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
            name = (data.get("metadata") or {}).get("name", "")
            if op == "DELETED":
                self.objects.pop(name, None)
            else:
                self.objects[name] = engines(data)
            self._apply()

    async def run_once(self) -> None:
        d = self.d
        if d.source == "endpointslices":
            await self._watch(EndpointSlice, {SERVICE_LABEL: d.name},
                              lambda o: slice_engines(d, o))
            return
        pool = await self.client.get(InferencePool, d.name, namespace=d.namespace)
        labels, ports = pool_selector(pool.to_dict() if hasattr(pool, "to_dict") else pool)
        if not labels or not ports:
            raise ValueError(f"InferencePool {d.name} has no selector or no target ports")
        await self._watch(Pod, labels, lambda o: pod_engines(d, o, ports))

    async def run(self) -> None:
        while True:
            try:
                await self.run_once()
                log.warning("discovery watch on %s ended; re-listing", self.d.name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the last known pool; try again
                log.warning("discovery watch on %s failed: %r; keeping %d engine(s)",
                            self.d.name, exc, len(self.router.engines))
            await asyncio.sleep(self.d.interval_ms / 1000)
