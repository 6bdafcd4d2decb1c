"""The Lease loop: reads and writes a ``coordination.k8s.io/v1`` Lease through lightkube
every ``retry_period`` and feeds the answers to ``core.leadership.Leadership``, which
decides. This module does I/O only; whether the router may admit is the core's call,
made per request against the clock.
"""

from __future__ import annotations

import asyncio
import logging
import time

from lightkube import AsyncClient
from lightkube.resources.coordination_v1 import Lease

from ..config import LeaderElection
from ..core.leadership import LeaseRecord, Write
from ..core.router import Router
from .kube import client, status_code

log = logging.getLogger("narwhal.leader")


def _lease(cfg: LeaderElection, w: Write) -> Lease:
    meta: dict[str, object] = {"name": cfg.lease_name, "namespace": cfg.namespace}
    if not w.create:
        meta["resourceVersion"] = w.record.resource_version
    return Lease.from_dict({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                            "metadata": meta, "spec": w.record.to_spec()})


class LeaseLoop:
    def __init__(self, router: Router, api: AsyncClient | None = None) -> None:
        assert router.leadership is not None
        self.router = router
        self.lead = router.leadership
        self.cfg = router.config.router.leader_election
        # A call must not outlive the renew deadline it is racing.
        self.client = api or client(self.cfg.api_server, self.cfg.namespace,
                                          self.lead.retry_period_s)
        self.state: str | None = "standby"

    async def step(self) -> None:
        clock = self.router.clock
        try:
            obj = await self.client.get(Lease, self.cfg.lease_name, namespace=self.cfg.namespace)
            record: LeaseRecord | None = LeaseRecord.from_object(obj.to_dict())
        except Exception as exc:  # an error answer, or no API server: the deadline decides
            if status_code(exc) != 404:
                log.warning("lease %s: read failed: %r", self.cfg.lease_name, exc)
                return
            record = None
        self.lead.observe(clock(), record)
        w = self.lead.decide(clock(), time.time())
        if w is not None:
            await self._write(w)

    async def _write(self, w: Write) -> None:
        clock = self.router.clock
        sent = clock()
        try:
            lease = _lease(self.cfg, w)
            if w.create:
                out = await self.client.create(lease, namespace=self.cfg.namespace)
            else:
                out = await self.client.replace(lease, namespace=self.cfg.namespace)
        except Exception as exc:
            if status_code(exc) != 409:  # 409: another replica wrote first, as designed
                log.warning("lease %s: write failed: %r", self.cfg.lease_name, exc)
            # Nothing to undo in the core: its deadline runs from the last success, and
            # the next read tells more.
            return
        self.lead.written(sent, clock(), LeaseRecord.from_object(out.to_dict()))
        if w.acquiring and self.lead.leading(clock()):
            log.info("lease %s acquired by %s (fencing token %s)", self.cfg.lease_name,
                     self.lead.identity, self.lead.token)

    def _notify(self) -> None:
        state = self.lead.reason(self.router.clock())
        if state != self.state:
            log.info("leadership: %s -> %s", self.state or "leader", state or "leader")
            self.state = state
            self.router.changed()

    async def run(self) -> None:
        period = self.lead.retry_period_s
        while True:
            started = self.router.clock()
            try:
                await self.step()
            except Exception:  # the loop must outlive any one bad answer
                log.exception("lease loop step failed")
            self._notify()
            await asyncio.sleep(max(0.0, period - (self.router.clock() - started)))

    async def release(self) -> None:
        """Stop admitting and hand the Lease over (shutdown)."""
        w = self.lead.release()
        self.router.changed()
        if w is None:
            return
        try:
            await self.client.replace(_lease(self.cfg, w), namespace=self.cfg.namespace)
            log.info("lease %s released by %s", self.cfg.lease_name, self.lead.identity)
        except Exception as exc:
            log.warning("lease %s: release failed: %r", self.cfg.lease_name, exc)
