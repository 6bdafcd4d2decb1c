"""One way to reach the Kubernetes API (lightkube): a plain URL for a proxy or a test
server, else the pod's service account, else $KUBECONFIG."""

from __future__ import annotations

from lightkube import ApiError, AsyncClient, KubeConfig


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
