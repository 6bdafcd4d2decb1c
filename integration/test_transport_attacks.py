"""The ext_proc port against a hostile peer (gateway mode exposes it): a raw HTTP/2 client
built on `h2` and hand-made frames, against a real `narwhal serve`. Each attack must cost
the router under 2 s of CPU and 20 MB of RSS (read from /proc) and leave the port
serving; none may take down another stream.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from narwhal.launch import SimSpec, Stack
from narwhal.server import http2
from narwhal.server.access_log import ACCESS_LOG_PATH
from narwhal.server.metrics import process_usage

from .conftest import _stack, wait_for

CHECK = "/grpc.health.v1.Health/Check"
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
CPU_S = 2.0
RSS_BYTES = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def router() -> Iterator[Stack]:
    yield from _stack([SimSpec("sim-t")], {"serving": {"preface_timeout_ms": 500,
                                                       "max_connections": 64,
                                                       "max_streams": 1000}})


class Usage:
    """CPU seconds and RSS of the router process, before and after an attack."""

    def __init__(self, stack: Stack) -> None:
        self.pid = stack.proc("narwhal").popen.pid
        self.cpu0, self.rss0 = self.sample()

    def sample(self) -> tuple[float, int]:
        return process_usage(self.pid)

    def check(self) -> None:
        cpu, rss = self.sample()
        assert cpu - self.cpu0 < CPU_S, f"attack cost {cpu - self.cpu0:.2f} s of CPU"
        assert rss - self.rss0 < RSS_BYTES, f"attack grew RSS by {(rss - self.rss0) >> 20} MB"


def serving(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.extproc_port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big")
            + payload)


class Peer:
    """An h2 client on a raw socket: well-formed frames from h2, anything else by hand."""

    def __init__(self, stack: Stack) -> None:
        self.sock = socket.create_connection(("127.0.0.1", stack.extproc_port), timeout=10)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        self.flush()

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def headers(self, path: str, end_stream: bool = False) -> int:
        sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, [(":method", "POST"), (":scheme", "http"),
                                   (":authority", "narwhal"), (":path", path),
                                   ("content-type", "application/grpc"), ("te", "trailers")],
                             end_stream=end_stream)
        self.flush()
        return sid

    def events(self, until, timeout: float = 10.0) -> list:
        """Read until ``until(events)`` holds or the server closes the connection."""
        out: list = []
        deadline = time.monotonic() + timeout
        while not until(out):
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
                if data:
                    out += self.h2.receive_data(data)
                    self.flush()
            except TimeoutError:
                raise AssertionError(f"no answer within {timeout}s: {out}") from None
            except (ConnectionResetError, BrokenPipeError):
                # The server aborted (a peer past the connection limit, or one still
                # sending LINGER_S after its GOAWAY): the kernel resets. Closed all the same.
                data = b""
            if not data:
                out.append("eof")
                break
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def grpc_status(events: list, sid: int) -> int | None:
    for ev in events:
        if isinstance(ev, h2.events.TrailersReceived | h2.events.ResponseReceived) \
                and ev.stream_id == sid:
            status = dict(ev.headers).get(b"grpc-status")
            if status is not None:
                return int(status)
    return None


@contextlib.contextmanager
def attack(stack: Stack) -> Iterator[Peer]:
    """One attack from a raw peer; afterwards the router must be within its CPU and RSS
    bounds and still serving."""
    usage = Usage(stack)
    peer = Peer(stack)
    try:
        yield peer
    finally:
        peer.close()
    usage.check()
    serving(stack)


def test_continuation_flood_is_cut_off(router):
    with attack(router) as peer:
        block = peer.h2.encoder.encode([(":method", "POST"), (":path", CHECK)])
        flood = frame(http2.HEADERS, 0, 1, block) + frame(http2.CONTINUATION, 0, 1) * 40_000
        with contextlib.suppress(OSError):  # the server may close before all of it is sent
            peer.sock.sendall(flood)
        events = peer.events(lambda evs: any(isinstance(e, h2.events.ConnectionTerminated)
                                             or e == "eof" for e in evs))
        terminated = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert terminated and terminated[0].error_code == http2.ENHANCE_YOUR_CALM


def test_oversized_message_is_resource_exhausted(router):
    with attack(router) as peer:
        sid = peer.headers(PROCESS)
        peer.h2.send_data(sid, b"\x00" + (63 * 1024 * 1024).to_bytes(4, "big") + b"x" * 1000)
        peer.flush()
        events = peer.events(lambda evs: grpc_status(evs, sid) is not None)
        assert grpc_status(events, sid) == 8  # RESOURCE_EXHAUSTED


def test_partial_messages_on_many_streams_are_bounded(router):
    """40 streams each sending most of a 4 MiB message: the connection window (8 MiB),
    not 160 MiB, bounds what the router holds; closing frees it."""
    with attack(router) as peer:
        peer.h2.increment_flow_control_window(1 << 30)
        peer.flush()
        sids = [peer.headers(PROCESS) for _ in range(40)]
        chunk = b"y" * 16384
        sent = 0
        for sid in sids:
            peer.h2.send_data(sid, b"\x00" + (4 * 1024 * 1024).to_bytes(4, "big"))
            while peer.h2.local_flow_control_window(sid) >= len(chunk) and \
                    peer.h2.max_outbound_frame_size >= len(chunk):
                peer.h2.send_data(sid, chunk)
                sent += len(chunk)
                peer.flush()
                if sent > 3 * 1024 * 1024 * (1 + sids.index(sid)):
                    break
        # The server granted at most its connection window, whatever the streams' windows.
        assert sent <= 8 * 1024 * 1024 + 40 * 16384


def test_a_peer_that_does_not_read_cannot_grow_the_router(router):
    """PINGs and health checks whose answers are never read: the router stops reading."""
    with attack(router) as peer:
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        ping = frame(http2.PING, 0, 0, b"12345678")
        peer.sock.settimeout(5)
        sent = 0
        with contextlib.suppress(TimeoutError, OSError):
            while sent < 64 * 1024 * 1024:  # stops when the router stops reading
                peer.sock.sendall(ping * 4096)
                sent += len(ping) * 4096
        assert sent < 64 * 1024 * 1024, "the router kept reading a peer that never reads"


def undecodable_beside_a_health_check(peer: Peer, path: str, end_stream: bool
                                      ) -> tuple[list, int]:
    """Bytes that decode as no message on a ``path`` stream and a good health check on
    another; the events until both are answered, and the bad stream's id. The check must
    pass and the connection stay up."""
    good = peer.headers(CHECK)
    bad = peer.headers(path)
    peer.h2.send_data(bad, b"\x00" + (3).to_bytes(4, "big") + b"\xff\xff\xff",
                      end_stream=end_stream)
    msg = health_pb2.HealthCheckRequest(service="").SerializeToString()
    peer.h2.send_data(good, b"\x00" + len(msg).to_bytes(4, "big") + msg, end_stream=True)
    peer.flush()
    events = peer.events(lambda evs: grpc_status(evs, good) is not None
                         and grpc_status(evs, bad) is not None)
    assert grpc_status(events, good) == 0
    assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events)
    return events, bad


def test_undecodable_health_check_fails_alone(router):
    with attack(router) as peer:
        events, bad = undecodable_beside_a_health_check(peer, CHECK, end_stream=True)
        assert grpc_status(events, bad) != 0


def test_an_undecodable_access_log_message_fails_its_stream_alone(router):
    """Envoy's access-log stream shares the ext_proc port: bytes that are no
    StreamAccessLogsMessage end that stream INVALID_ARGUMENT, saying so, and nothing else."""
    with attack(router) as peer:
        events, bad = undecodable_beside_a_health_check(peer, ACCESS_LOG_PATH, end_stream=False)
        assert grpc_status(events, bad) == 3  # INVALID_ARGUMENT
        trailers = next(dict(e.headers) for e in events
                        if isinstance(e, h2.events.TrailersReceived | h2.events.ResponseReceived)
                        and e.stream_id == bad)
        assert trailers[b"grpc-message"] == b"undecodable StreamAccessLogsMessage"


def test_connections_without_a_preface_are_closed(router):
    usage = Usage(router)
    socks = [socket.create_connection(("127.0.0.1", router.extproc_port), timeout=10)
             for _ in range(300)]
    try:
        for s in socks:  # each is closed by the router: over the limit at once, else in 0.5 s
            s.settimeout(10)
            while True:
                try:
                    if not s.recv(65536):
                        break
                except ConnectionResetError:
                    break
    finally:
        for s in socks:
            s.close()
    usage.check()
    serving(router)


def test_echoed_bodies_not_read_back_are_bounded(router):
    """Pass-through bodies come back as body mutations: a peer that sends 32 MiB of them and
    reads nothing gets its input held once its output is, not an ever-growing buffer."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    with attack(router) as peer:
        peer.h2.increment_flow_control_window(1 << 30)
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sid = peer.headers(PROCESS)
        hdrs = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models"),
                                           base_pb2.HeaderValue(key=":method", raw_value=b"GET")])
        first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hdrs)).SerializeToString()
        chunk = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"e" * (1 << 20))).SerializeToString()
        messages = [first] + [chunk] * 32
        sent = 0
        peer.sock.settimeout(3)
        with contextlib.suppress(TimeoutError, OSError):
            for m in messages:
                data = b"\x00" + len(m).to_bytes(4, "big") + m
                for i in range(0, len(data), 16384):
                    if peer.h2.local_flow_control_window(sid) < 16384:
                        raise TimeoutError  # the router stopped granting window: held
                    peer.h2.send_data(sid, data[i:i + 16384])
                    peer.flush()
                    sent += 16384
        assert sent < 32 << 20, "the router kept accepting input it could not send back"





WATCH = "/grpc.health.v1.Health/Watch"
EMPTY_MESSAGE = b"\x00\x00\x00\x00\x00"  # a gRPC frame of an empty protobuf


def test_open_streams_are_bounded_across_connections(router):
    """1,100 health Watch streams (each open for as long as its peer keeps it): past
    serving.max_streams (1,000 here) each new one is answered RESOURCE_EXHAUSTED at once,
    in order, so the router holds at most that many calls' state whatever a peer opens
    (before: 16,384 a connection, ~2 KB each, on each of max_connections); the bound is
    the process's, so another connection's stream is refused too; once the peer goes, the
    port serves again."""
    with attack(router) as peer:
        peer.events(settings_received)  # the router's stream limit, before opening past h2's 100
        sids = []
        for _ in range(1100):
            sid = peer.headers(WATCH)
            peer.h2.send_data(sid, EMPTY_MESSAGE, end_stream=True)
            sids.append(sid)
        peer.flush()
        events = peer.events(lambda evs: sum(grpc_status(evs, s) is not None
                                             for s in sids) >= 95, timeout=20)
        refused = [s for s in sids if grpc_status(events, s) is not None]
        first = sids.index(refused[0])
        assert 990 <= first <= 1000  # a stream or two of other tests' peers may still be open
        assert refused == sids[first:first + len(refused)]  # the newest, in order
        assert {grpc_status(events, s) for s in refused} == {8}  # RESOURCE_EXHAUSTED
        other = Peer(router)
        try:
            other.events(settings_received)
            sid = other.headers(CHECK)
            other.h2.send_data(sid, EMPTY_MESSAGE, end_stream=True)
            other.flush()
            assert grpc_status(other.events(lambda evs: grpc_status(evs, sid) is not None),
                               sid) == 8
        finally:
            other.close()
        peer.close()

        def recovered() -> bool:
            try:
                serving(router)
            except grpc.RpcError:
                return False  # the router has not yet read the peer's close
            return True

        wait_for(recovered)


def test_a_stream_without_a_message_is_ended(router):
    """A stream opened and never written to ends DEADLINE_EXCEEDED within two ticks of
    serving.preface_timeout_ms (0.5 s here), its place given back; one whose first message
    came stays open (before: both held their places for as long as the connection)."""
    with attack(router) as peer:
        silent = peer.headers(PROCESS)
        watch = peer.headers(WATCH)
        peer.h2.send_data(watch, EMPTY_MESSAGE, end_stream=True)
        peer.flush()
        events = peer.events(lambda evs: grpc_status(evs, silent) is not None)
        assert grpc_status(events, silent) == 4  # DEADLINE_EXCEEDED
        assert grpc_status(events, watch) is None  # still watching
        assert not any(isinstance(e, h2.events.StreamEnded) and e.stream_id == watch
                       for e in events)


def settings_received(evs: list) -> bool:
    return any(isinstance(e, h2.events.RemoteSettingsChanged) for e in evs)


def open_watches(peer: Peer, n: int) -> list[int]:
    """``n`` health Watch streams, each with its first message: open until the peer goes."""
    return [message_stream(peer, WATCH) for _ in range(n)]


def message_stream(peer: Peer, path: str) -> int:
    """A ``path`` stream with an empty message and the client's half-close."""
    sid = peer.headers(path)
    peer.h2.send_data(sid, EMPTY_MESSAGE, end_stream=True)
    peer.flush()
    return sid


def check_answered(peer: Peer, timeout: float = 60.0) -> None:
    """A health check on the attacker's own connection, answered after everything it sent
    before (a connection's frames are read in order): the attack's work is done."""
    sid = message_stream(peer, CHECK)
    events = peer.events(lambda evs: grpc_status(evs, sid) is not None, timeout=timeout)
    assert grpc_status(events, sid) == 0


def test_a_settings_flood_over_open_streams_is_cheap(router):
    """SETTINGS frames full of SETTINGS_INITIAL_WINDOW_SIZE entries (2,730 in a 16 KB frame)
    over 900 open streams. Each entry changes every open stream's window: kept one by one,
    that was a pass over the streams an entry (2 s of CPU for one frame over 16,384
    streams); kept relative to the initial window it is one assignment."""
    with attack(router) as peer:
        peer.events(settings_received)
        open_watches(peer, 900)
        entries = ((0x4).to_bytes(2, "big") + (65535).to_bytes(4, "big")) * 2730
        peer.sock.sendall(frame(http2.SETTINGS, 0, 0, entries) * 40)
        check_answered(peer)


def test_connection_window_updates_wake_only_streams_that_can_send(router):
    """900 health checks whose answers wait for stream window the peer never gives (its
    SETTINGS_INITIAL_WINDOW_SIZE is 0), then 20,000 connection WINDOW_UPDATEs of a byte
    each. Each update walked every waiting stream (18 million tries to send nothing); now
    it wakes only the streams waiting for the connection's window, and stops once that is
    spent."""
    with attack(router) as peer:
        peer.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        peer.flush()
        peer.events(lambda evs: any(isinstance(e, h2.events.SettingsAcknowledged)
                                    for e in evs))
        sids = {message_stream(peer, CHECK) for _ in range(900)}
        answered: set[int] = set()

        def headers_back(evs: list) -> bool:
            answered.update(e.stream_id for e in evs if isinstance(e, h2.events.ResponseReceived))
            return answered >= sids

        peer.events(headers_back)  # each answer's headers; its message waits for window
        peer.sock.sendall(frame(http2.WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")) * 20_000)
        peer.h2.ping(b"after-it")
        peer.flush()
        events = peer.events(lambda evs: any(isinstance(e, h2.events.PingAckReceived)
                                             for e in evs), timeout=60)
        assert not any(isinstance(e, h2.events.DataReceived) for e in events)


def test_streams_reset_before_their_first_message_end_the_connection(router):
    """HTTP/2 rapid reset (CVE-2023-44487): streams opened and reset at once, which never
    count against serving.max_streams, each cost the router a call's setup. Past 100
    streams reset before their first message, at least half of a connection's streams,
    the connection ends with GOAWAY ENHANCE_YOUR_CALM (Envoy writes an ext_proc stream's
    first message as it opens it, and resets streams only after). Another connection's
    stream is untouched."""
    other = Peer(router)
    try:
        other.events(settings_received)
        (watch,) = open_watches(other, 1)
        other.events(lambda evs: any(isinstance(e, h2.events.DataReceived)
                                     and e.stream_id == watch for e in evs))
        with attack(router) as peer:
            peer.events(settings_received)
            with contextlib.suppress(OSError):  # the router may close before all is sent
                for _ in range(5000):
                    peer.h2.reset_stream(peer.headers(PROCESS))
                    peer.flush()
            events = peer.events(lambda evs: any(
                isinstance(e, h2.events.ConnectionTerminated) or e == "eof" for e in evs))
            terminated = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
            assert terminated and terminated[0].error_code == http2.ENHANCE_YOUR_CALM
            # Cut off at the 100th (the GOAWAY names the last stream of the read it was in).
            assert terminated[0].additional_data.startswith(
                b"100 streams reset before their first message")
        other.h2.ping(b"still-up")
        other.flush()
        events = other.events(lambda evs: any(isinstance(e, h2.events.PingAckReceived)
                                              for e in evs))
        assert not any(isinstance(e, h2.events.ConnectionTerminated | h2.events.StreamEnded
                                  | h2.events.StreamReset) for e in events)
    finally:
        other.close()
