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
above it are both measured, not argued. ``null_extproc.c`` beside it is the same
processor compiled (``--configs cnull``): the floor of any processor, and what Envoy
itself costs beside one that costs almost nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from narwhal.config import Serving
from narwhal.core.exchange import DESTINATION_HEADER, Body, Headers, Trailers
from narwhal.server.access_log import ACCESS_LOG_PATH, AccessLogCall
from narwhal.server.app import listen_grpc
from narwhal.server.extproc import PROCESS_PATH, encode
from narwhal.server.grpc_server import Stream
from narwhal.server.loop import install_uvloop

# Which of ``fixed_replies`` answers each message that is not a body.
FIXED = {"request_headers": 0, "response_headers": 1, "request_trailers": 2,
         "response_trailers": 3}


class NullCall:
    """One ext_proc stream: each message answered at once, as the protocol requires."""

    __slots__ = ("stream", "fixed")

    def __init__(self, fixed: list[bytes], stream: Stream) -> None:
        self.stream = stream
        self.fixed = fixed

    def on_message(self, data: bytes) -> None:
        msg = self.stream.decode(pb.ProcessingRequest, data)
        if msg is None:
            return
        kind = msg.WhichOneof("request")
        if kind == "response_body":
            body = msg.response_body
            self.stream.send(encode(Body(True, body.body, body.end_of_stream)))
        elif kind == "request_body":
            # As Narwhal asks every engine for a stream: the answer then comes in the same
            # messages as Narwhal's (the same length: no content-length to change).
            body = msg.request_body
            data = body.body.replace(b'"stream":false', b'"stream":true ')
            self.stream.send(encode(Body(False, data, body.end_of_stream)))
        elif kind is not None:
            self.stream.send(self.fixed[FIXED[kind]])

    def on_half_close(self) -> None:
        self.stream.finish()

    def on_cancel(self) -> None:
        pass


def fixed_replies(destination: str) -> list[bytes]:
    """The replies that do not depend on a message's content, serialized by Narwhal's own
    encoder (in ``FIXED``'s order, the compiled processor's arguments): request headers
    with the destination header and metadata Narwhal sets, response headers, request and
    response trailers passed."""
    return [encode(Headers(False, destination=destination,
                           set=[(DESTINATION_HEADER, destination)])),
            encode(Headers(True)), encode(Trailers(False)), encode(Trailers(True))]


def python_command(socket_path: str, destination: str) -> list[str]:
    """The command line that serves this processor on ``socket_path`` (run from the
    repository's root)."""
    return [sys.executable, "-m", "bench.null_extproc", "--socket", socket_path,
            "--destination", destination]


def compiled_command(socket_path: str, destination: str, build_dir: Path) -> list[str]:
    """Build ``null_extproc.c`` (nghttp2, a C compiler: ``scripts/native-tools.sh``
    installs both) into ``build_dir``; the command line that serves it on ``socket_path``."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not Path("/usr/include/nghttp2/nghttp2.h").exists():
        raise SystemExit("bench: the compiled null processor needs a C compiler and "
                         "nghttp2's headers (scripts/native-tools.sh installs them)")
    exe, source = build_dir / "null_extproc_c", Path(__file__).with_name("null_extproc.c")
    if not exe.exists() or exe.stat().st_mtime < source.stat().st_mtime:  # once a run
        subprocess.run([cc, "-O2", "-o", str(exe), str(source), "-lnghttp2"], check=True)
    return [str(exe), socket_path, *(r.hex() for r in fixed_replies(destination))]


def _no_verdict(request_id: str, verdict: str) -> None:
    """Nothing waits for a verdict here."""


async def serve(socket_path: str, destination: str) -> None:
    # Envoy's access log of failed requests (the shipped config sends it to the ext_proc
    # cluster) is read and its verdicts dropped: there are no requests to settle.
    fixed = fixed_replies(destination)
    routes = {PROCESS_PATH: lambda st: NullCall(fixed, st),
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
