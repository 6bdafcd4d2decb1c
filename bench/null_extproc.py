"""A null ext_proc processor: Narwhal's transport, answering every message with no logic.

    python -m bench.null_extproc --socket PATH --destination HOST:PORT

It speaks what Narwhal speaks to Envoy, on the same code (``grpc_server``'s HTTP/2 and
gRPC framing on the event loop, upb's decode of each ``ProcessingRequest``, the adapter's
``encode`` of each reply): request headers answered with the destination header and
``envoy.lb`` metadata Narwhal sets, both bodies echoed whole (``FULL_DUPLEX_STREAMED``
wants them back; a compact ``"stream":false`` in the request becomes ``"stream":true``,
as Narwhal asks engines for a stream, so that the engine's answer comes in the same
messages), trailers and response headers passed. No validation, admission, placement,
parsing of the answer, counting or learning.

Why it exists: the data-path benchmark measures it side by side with Narwhal
(``--configs null``), so that the CPU any Python processor in Narwhal's place costs per
message (the floor its targets are judged against) and what Narwhal's own work adds
above it are both measured, not argued.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from narwhal.config import Serving
from narwhal.core.exchange import DESTINATION_HEADER, Action, Body, Headers, Trailers
from narwhal.server.access_log import ACCESS_LOG_PATH, AccessLogCall
from narwhal.server.app import listen_grpc
from narwhal.server.extproc import PROCESS_PATH, encode
from narwhal.server.grpc_server import INVALID_ARGUMENT, Stream
from narwhal.server.loop import install_uvloop


class NullCall:
    """One ext_proc stream: each message answered at once, as the protocol requires."""

    __slots__ = ("stream", "destination")

    def __init__(self, destination: str, stream: Stream) -> None:
        self.stream = stream
        self.destination = destination

    def on_message(self, data: bytes) -> None:
        try:
            msg = pb.ProcessingRequest.FromString(data)
        except Exception:  # upb raises its own DecodeError type
            self.stream.finish(INVALID_ARGUMENT, "undecodable ProcessingRequest")
            return
        reply = self.reply(msg)
        if reply is not None:
            self.stream.send(encode(reply))

    def reply(self, msg: pb.ProcessingRequest) -> Action | None:
        kind = msg.WhichOneof("request")
        if kind == "response_body":
            return Body(True, msg.response_body.body, msg.response_body.end_of_stream)
        if kind == "request_body":
            # As Narwhal asks every engine for a stream: the answer then comes in the same
            # messages as Narwhal's (the same length: no content-length to change).
            body = msg.request_body.body.replace(b'"stream":false', b'"stream":true ')
            return Body(False, body, msg.request_body.end_of_stream)
        if kind == "request_headers":
            dest = self.destination
            return Headers(False, destination=dest, set=[(DESTINATION_HEADER, dest)])
        if kind == "response_headers":
            return Headers(True)
        if kind in ("request_trailers", "response_trailers"):
            return Trailers(kind == "response_trailers")
        return None

    def on_half_close(self) -> None:
        self.stream.finish()

    def on_cancel(self) -> None:
        pass


def _no_verdict(request_id: str, verdict: str) -> None:
    """Nothing waits for a verdict here."""


async def serve(socket_path: str, destination: str) -> None:
    # Envoy's access log of failed requests (the shipped config sends it to the ext_proc
    # cluster) is read and its verdicts dropped: there are no requests to settle.
    routes = {PROCESS_PATH: lambda st: NullCall(destination, st),
              ACCESS_LOG_PATH: functools.partial(AccessLogCall, _no_verdict)}
    stop = await listen_grpc(Serving(), routes, None, socket_path)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    await stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="Unix socket to serve ext_proc on")
    parser.add_argument("--destination", required=True, help="the engine's host:port")
    args = parser.parse_args()
    install_uvloop()  # as narwhal serve does (NARWHAL_LOOP=asyncio: asyncio's loop)
    asyncio.run(serve(args.socket, args.destination))


if __name__ == "__main__":
    main()
