"""Envoy's gRPC access log service on the ext_proc port, for one thing: the verdict on
requests that ended mid-response (see ``core/closes.py``).

Envoy is configured to send only entries flagged with an upstream failure, so this
costs nothing on requests that end normally. An entry whose flags name the engine's side
(reset, connection termination or failure, protocol error, timeout) makes that request
``failed``; one that names the client's side keeps it ``cancelled``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from envoy.service.accesslog.v3 import als_pb2

from ..core import errors
from .grpc_server import Stream

log = logging.getLogger("narwhal.access_log")
ACCESS_LOG_PATH = b"/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
ENGINE_SIDE = ("upstream_remote_reset", "upstream_connection_termination",
               "upstream_connection_failure", "upstream_protocol_error",
               "upstream_request_timeout", "no_healthy_upstream", "upstream_overflow",
               "upstream_max_stream_duration_reached", "upstream_retry_limit_exceeded")


def verdict(flags: object) -> str:
    return errors.FAILED if any(getattr(flags, name) for name in ENGINE_SIDE) \
        else errors.CANCELLED


class AccessLogCall:
    """One StreamAccessLogs stream: entries in, nothing out until Envoy closes it.
    ``logged(request_id, verdict)``: the router's ``closes.logged``, or a worker's
    forwarding to the scheduler process."""

    __slots__ = ("logged", "stream")

    def __init__(self, logged: Callable[[str, str], None], stream: Stream) -> None:
        self.logged = logged
        self.stream = stream

    def on_message(self, data: bytes) -> None:
        msg = self.stream.decode(als_pb2.StreamAccessLogsMessage, data)
        if msg is None:
            return
        for entry in msg.http_logs.log_entry:
            request_id = entry.request.request_id
            if request_id:
                self.logged(request_id, verdict(entry.common_properties.response_flags))

    def on_half_close(self) -> None:
        self.stream.finish()

    def on_cancel(self) -> None:
        pass
