"""One way to reach the Kubernetes API (lightkube): a plain URL for a proxy or a test
server, else the pod's service account, else $KUBECONFIG; and one way to follow a kind
of object (``mirror``: list, then watch from the list's version)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.core.exceptions import NotReadyError

T = TypeVar("T")


def client(api_server: str, namespace: str, timeout_s: float | None) -> AsyncClient:
    if api_server:  # no credentials
        kube = KubeConfig.from_dict({
            "clusters": [{"name": "api", "cluster": {"server": api_server}}],
            "users": [{"name": "narwhal", "user": {}}],
            "contexts": [{"name": "narwhal", "context": {"cluster": "api", "user": "narwhal",
                                                          "namespace": namespace}}],
            "current-context": "narwhal"})
    else:
        kube = KubeConfig.from_env()
    return AsyncClient(kube, namespace=namespace, timeout=timeout_s, trust_env=False)


def status_code(exc: BaseException) -> int | None:
    """The HTTP status of an error answer (lightkube's ApiError or the HTTP client's)."""
    if isinstance(exc, ApiError) and exc.status is not None and exc.status.code:
        return int(exc.status.code)
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def as_dict(obj: Any) -> dict[str, Any]:
    """An API object as plain data (lightkube's models and generic resources both)."""
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def name_of(data: dict[str, Any]) -> str:
    """An object's name ("" where the API sent none)."""
    return (data.get("metadata") or {}).get("name", "")


async def mirror(api: AsyncClient, resource: Any, namespace: str, labels: dict[str, str] | None,
                 derive: Callable[[dict[str, Any]], T],
                 changed: Callable[[dict[str, T]], None]) -> None:
    """Keep ``changed`` told of what every object of ``resource`` in ``namespace`` (that
    ``labels`` select) derives to, by name: once after a LIST, then after each change a
    WATCH from the list's ``resourceVersion`` reports (the API's informer pattern). Why a
    list first: a watch without a version replays only the objects that exist, so an
    object deleted while no watch ran would otherwise stay; and one started from the
    list's version misses no change made in between. Returns when the watch ends (the
    caller lists again); raises what the API answers (404 for a kind it does not serve,
    410 for a version too old)."""
    state: dict[str, T] = {}
    listing = api.list(resource, namespace=namespace, labels=labels)
    async for obj in listing:
        data = as_dict(obj)
        state[name_of(data)] = derive(data)
    changed(state)
    try:
        version: str | None = listing.resourceVersion
    except NotReadyError:  # an empty list without a version: start from now
        version = None
    async for op, obj in api.watch(resource, namespace=namespace, labels=labels,
                                   resource_version=version):
        data = as_dict(obj)
        name = name_of(data)
        if op == "DELETED":
            state.pop(name, None)
        elif op in ("ADDED", "MODIFIED"):
            state[name] = derive(data)
        else:  # BOOKMARK: a version only
            continue
        changed(state)
