"""gRPC health (grpc.health.v1) for the asyncio transport: Check and Watch.

Check answers from the router's state at the moment of the call, so it can never
disagree with /ready; Watch streams push on every router state change.
"""

from __future__ import annotations

from collections.abc import Callable

from grpc_health.v1 import health_pb2

from .grpc_server import NOT_FOUND, Stream

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
CHECK_PATH = b"/grpc.health.v1.Health/Check"
WATCH_PATH = b"/grpc.health.v1.Health/Watch"
# Names that mean "may Envoy send ext_proc streams here" (the last: the ext_proc service).
READINESS_SERVICES = ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


def serving_status(service: str, not_ready: Callable[[], str | None]) -> int | None:
    """gRPC health per service name, from why the router does not serve (None: it does);
    None for names Narwhal does not serve."""
    if service == "liveness":
        return SERVING
    if service in READINESS_SERVICES:
        return SERVING if not_ready() is None else NOT_SERVING
    return None


def _response(status: int) -> bytes:
    return health_pb2.HealthCheckResponse(status=status).SerializeToString()


class HealthRegistry:
    def __init__(self, status_of: Callable[[str], int | None]) -> None:
        self.status_of = status_of
        self.watchers: dict[Stream, tuple[str, int]] = {}

    def refresh(self) -> None:
        for st, (service, last) in list(self.watchers.items()):
            status = self.status_of(service)
            status = SERVICE_UNKNOWN if status is None else status
            if status != last:
                self.watchers[st] = (service, status)
                st.send(_response(status))
                st.conn.write_soon()

    def check_call(self, stream: Stream) -> _Check:
        return _Check(self, stream)

    def watch_call(self, stream: Stream) -> _Watch:
        return _Watch(self, stream)


class _Check:
    __slots__ = ("reg", "stream")

    def __init__(self, reg: HealthRegistry, stream: Stream) -> None:
        self.reg, self.stream = reg, stream

    def on_message(self, data: bytes) -> None:
        status = self.reg.status_of(health_pb2.HealthCheckRequest.FromString(data).service)
        if status is None:
            self.stream.finish(NOT_FOUND, "unknown service")
            return
        self.stream.send(_response(status))
        self.stream.finish()

    def on_half_close(self) -> None:
        self.stream.finish()

    def on_cancel(self) -> None:
        pass


class _Watch:
    __slots__ = ("reg", "stream")

    def __init__(self, reg: HealthRegistry, stream: Stream) -> None:
        self.reg, self.stream = reg, stream

    def on_message(self, data: bytes) -> None:
        service = health_pb2.HealthCheckRequest.FromString(data).service
        status = self.reg.status_of(service)
        status = SERVICE_UNKNOWN if status is None else status
        self.reg.watchers[self.stream] = (service, status)
        self.stream.send(_response(status))

    def on_half_close(self) -> None:
        pass  # a watch lives until the client cancels it

    def on_cancel(self) -> None:
        self.reg.watchers.pop(self.stream, None)
