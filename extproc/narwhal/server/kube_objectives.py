"""Request priorities from the API server: the pool's InferenceObjectives.

Why: in a Gateway API Inference Extension deployment the workload owners declare how
important a use of the pool is on an InferenceObjective
(``inference.networking.x-k8s.io/v1alpha2``: ``spec.priority``, ``spec.poolRef``), and
clients name it in ``x-gateway-inference-objective``; the Extension's own picker reads
them there, not from its configuration. With ``engines: {discovery: kubernetes, source:
inferencepool}`` Narwhal follows the objectives whose ``poolRef`` names its pool, so a
priority changes with ``kubectl apply`` and no restart. An objective's priority wins over
``admission.objectives`` for its name; the configured map still names the rest. An unset
priority is 0 (as the Extension reads it); one outside Narwhal's [-1000, 1000] is clamped
(the order of any two stays, unless both lie beyond one bound); an objective whose
priority is not an integer, or that names another pool, gives none.

The function that reads an object is pure (unit-tested); ``follow_objectives`` does the I/O.
"""

from __future__ import annotations

import logging
from typing import Any

from lightkube import AsyncClient
from lightkube.generic_resource import create_namespaced_resource

from ..config import PRIORITY_BOUND, Discovery
from ..core.router import Router
from .kube import mirror

log = logging.getLogger("narwhal.discovery")
InferenceObjective = create_namespaced_resource(
    "inference.networking.x-k8s.io", "v1alpha2", "InferenceObjective", "inferenceobjectives")
POOL_GROUPS = ("", "inference.networking.k8s.io", "inference.networking.x-k8s.io")


def objective_priority(obj: dict[str, Any], pool: str) -> int | None:
    """The priority an InferenceObjective gives the requests that name it, or None when
    it is for another pool (``poolRef``: an InferencePool of either API group, by name)
    or its priority is not an integer."""
    spec = obj.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("poolRef"), dict):
        return None
    ref = spec["poolRef"]
    if (ref.get("name") != pool or ref.get("kind", "InferencePool") not in ("", "InferencePool")
            or ref.get("group", "") not in POOL_GROUPS):
        return None
    priority = spec.get("priority", 0)
    if priority is None:
        return 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        return None
    return max(-PRIORITY_BOUND, min(PRIORITY_BOUND, priority))


async def follow_objectives(router: Router, d: Discovery, api: AsyncClient) -> None:
    """Keep ``router.objectives`` the configured map under the pool's objectives, until
    the watch ends or fails (the caller retries; the last map stays meanwhile)."""
    configured = router.config.admission.objectives

    def changed(found: dict[str, int | None]) -> None:
        objectives = dict(configured)
        objectives.update((name, p) for name, p in found.items() if p is not None)
        if objectives != router.objectives:
            log.info("InferenceObjectives for pool %s: %d named (%d from the API server)",
                     d.name, len(objectives), sum(p is not None for p in found.values()))
        router.objectives = objectives

    await mirror(api, InferenceObjective, d.namespace, None,
                 lambda o: objective_priority(o, d.name), changed)
