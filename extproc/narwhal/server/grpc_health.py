"""gRPC health (grpc.health.v1) for the h2 transport: Check and Watch, per service name."""

from __future__ import annotations

from grpc_health.v1 import health_pb2

from .grpc_server import NOT_FOUND, Stream

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
CHECK_PATH = b"/grpc.health.v1.Health/Check"
WATCH_PATH = b"/grpc.health.v1.Health/Watch"


class HealthRegistry:
    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.watchers: dict[str, set[Stream]] = {}

    def set(self, service: str, status: int) -> None:
        if self.status.get(service) == status:
            return
        self.status[service] = status
        data = health_pb2.HealthCheckResponse(status=status).SerializeToString()
        for st in list(self.watchers.get(service, ())):
            st.send(data)
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
        service = health_pb2.HealthCheckRequest.FromString(data).service
        status = self.reg.status.get(service)
        if status is None:
            self.stream.finish(NOT_FOUND, "unknown service")
            return
        self.stream.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        self.stream.finish()

    def on_half_close(self) -> None:
        self.stream.finish()

    def on_cancel(self) -> None:
        pass


class _Watch:
    __slots__ = ("reg", "stream", "service")

    def __init__(self, reg: HealthRegistry, stream: Stream) -> None:
        self.reg, self.stream, self.service = reg, stream, None

    def on_message(self, data: bytes) -> None:
        self.service = health_pb2.HealthCheckRequest.FromString(data).service
        self.reg.watchers.setdefault(self.service, set()).add(self.stream)
        status = self.reg.status.get(self.service, SERVICE_UNKNOWN)
        self.stream.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())

    def on_half_close(self) -> None:
        pass  # a watch lives until the client cancels it

    def on_cancel(self) -> None:
        if self.service is not None:
            self.reg.watchers.get(self.service, set()).discard(self.stream)
