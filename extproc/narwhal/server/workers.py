"""``serving.workers: N``: ext_proc worker processes around one scheduler process.

Why this shape. A request costs Narwhal a few admission and placement decisions and
then one ext_proc message per engine write (every token of a stream). The decisions
need one shared state (the queue, slots, retention, the learned models); the token
messages need only the exchange they belong to. So the process that owns the router
(the *scheduler*, ``narwhal serve`` itself) keeps every decision, and N *workers* hold
Envoy's ext_proc streams:

* until a request is sent upstream, its worker forwards the stream's messages as they
  are (no decoding) to the scheduler, which runs the exchange exactly as a single
  process does (admission, the queue, refusals) and sends the replies back;
* the scheduler then hands the exchange over (``core/handoff.py``) in the same frame
  batch as the reply that sends it upstream, and the worker drives the response phase
  locally; what it does to shared state (served-by, first token, release, the terminal
  count, a close awaiting Envoy's verdict) goes back as ``Control`` calls, which the
  scheduler applies with the same code a single process runs.

So the protocol is per request, not per token: a handful of frames each way (and, per
engine, the first token of each step it sees, and back to every worker at most four a
stall timeout saying that the engine answers: ``Workers.active``). Frames are
msgpack lists behind a 4-byte length on a socketpair per worker, written once per
event-loop turn. A stream that ends before the handoff reaches the worker is closed on
the scheduler's side as it would be in one process; a worker that dies takes its
streams with it (each is closed on the scheduler's side: nothing stays held) and is
started again.

Limits: the asyncio transport only; worker ``i`` serves ext_proc (and Envoy's access log
and gRPC health) on the Unix socket ``<serving.extproc_socket>.<i>``, which Envoy's
``narwhal`` cluster lists; the scheduler keeps serving on its own port and socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ..config import Config, ConfigError, EngineConfig
from ..core.control import Control, Outcome
from ..core.engines import EngineState
from ..core.exchange import Action, Exchange, Phase
from ..core.handoff import resume, snapshot
from ..core.router import Router
from ..core.steps import MIN_GAP_S
from .access_log import ACCESS_LOG_PATH, AccessLogCall
from .driver import Driver, Runtime
from .extproc import PROCESS_PATH, ExtProcCall, _dispatch, send_actions
from .grpc_health import CHECK_PATH, WATCH_PATH, HealthRegistry, serving_status
from .grpc_server import INVALID_ARGUMENT, OK, GrpcConnection, Stream
from .metrics import process_usage

log = logging.getLogger("narwhal.workers")

# Worker -> scheduler frames: [kind, stream id, ...]. A stream's first message is W_OPEN:
# a W_MSG for a stream the scheduler does not hold (it ended it meanwhile) is dropped.
# W_STATS: [kind, objects its cyclic collector freed, found uncollectable], asked by S_STATS.
(W_HELLO, W_OPEN, W_MSG, W_CLOSE, W_SERVED, W_FIRST, W_RELEASE, W_COUNT, W_CLOSED,
 W_VERDICT, W_TOKEN, W_STATS) = range(12)
# Scheduler -> worker frames. S_ACTIVE: [kind, engine name, endpoint, time of a token
# from it], so that each worker knows the engine answers requests on other workers too.
# S_STATS: [kind], when /metrics or /status is read (W_STATS answers).
S_SEND, S_FINISH, S_HANDOFF, S_READY, S_ACTIVE, S_STATS = range(6)
MAX_FRAME = 64 * 1024 * 1024  # an ext_proc message is at most serving.max_message_bytes
LINK_HIGH = 4 * 1024 * 1024  # a link's unsent bytes above which its feeders stop reading
HELLO_TIMEOUT_S = 60.0
STATS_TIMEOUT_S = 1.0  # a worker's W_STATS later than this leaves its last figures shown
RESTART_DELAY_S = 1.0
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def worker_socket(config: Config, index: int) -> str:
    return f"{config.serving.extproc_socket}.{index}"


class Link(asyncio.Protocol):
    """Length-prefixed msgpack frames on a local stream socket; sends are gathered and
    written once per event-loop turn."""

    def __init__(self, on_frame: Callable[[list[Any]], None],
                 on_lost: Callable[[], None]) -> None:
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.on_full: Callable[[bool], None] = lambda full: None
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.out: list[bytes] = []
        self.scheduled = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.transport.set_write_buffer_limits(high=LINK_HIGH)

    def pause_writing(self) -> None:
        """The other process is not keeping up: whoever feeds this link waits."""
        self.on_full(True)

    def resume_writing(self) -> None:
        self.on_full(False)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while len(buf) - pos >= 4:
            n = int.from_bytes(buf[pos:pos + 4], "big")
            if n > MAX_FRAME:
                log.error("worker link: a %d-byte frame; closing the link", n)
                assert self.transport is not None
                self.transport.close()
                return
            if len(buf) - pos - 4 < n:
                break
            frame = _decode(bytes(buf[pos + 4:pos + 4 + n]))
            pos += 4 + n
            try:
                self.on_frame(frame)
            except Exception:  # one bad frame must not take the link down
                log.exception("worker link: frame %r failed", frame[:2])
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.on_lost()

    def send(self, frame: tuple[Any, ...]) -> None:
        data = _encode(frame)
        self.out += (len(data).to_bytes(4, "big"), data)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.scheduled = False
        out, self.out = self.out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))


# -- the scheduler's side ----------------------------------------------------------------

class RemoteStream:
    """The ``Stream`` a scheduler-side call writes to: the worker holds the real one."""

    __slots__ = ("port", "sid")

    def __init__(self, port: WorkerPort, sid: int) -> None:
        self.port = port
        self.sid = sid

    @property
    def conn(self) -> RemoteStream:
        """Itself (``write_soon``: the link writes once per loop turn anyway); a property,
        not an attribute, which would make each stream a cycle."""
        return self

    def send(self, message: bytes) -> None:
        self.port.link.send((S_SEND, self.sid, message))

    def finish(self, status: int = OK, message: str = "") -> None:
        self.port.finished(self.sid, status, message)

    def write_soon(self) -> None:
        pass


class RemoteCall(ExtProcCall):
    """A stream a worker holds, run here until its exchange is sent upstream."""

    __slots__ = ("handed",)

    def __init__(self, runtime: Runtime, stream: RemoteStream) -> None:
        super().__init__(runtime, stream)  # type: ignore[arg-type]
        self.handed = False

    def _send(self, actions: list[Action]) -> None:
        ex = self.driver.ex
        if not self.handed and ex.phase is Phase.UPSTREAM and ex.terminal is None:
            # Before the reply that sends it upstream: the response can only come after.
            self.handed = True
            ex.handed_off()
            stream = self.stream
            assert isinstance(stream, RemoteStream)
            stream.port.handoffs += 1
            stream.port.link.send((S_HANDOFF, stream.sid, snapshot(ex)))
            if not ex.completion:  # a pass-through holds nothing here: done with it
                stream.port.calls.pop(stream.sid, None)
                super()._send(actions)
                self.driver.closed()
                return
        super()._send(actions)


class WorkerPort:
    """The scheduler's end of one worker's link."""

    def __init__(self, runtime: Runtime, index: int) -> None:
        self.runtime = runtime
        self.index = index
        self.calls: dict[int, RemoteCall] = {}
        # Released by their worker, their terminal count not yet received (a worker that
        # dies between the two frames must not leave them uncounted).
        self.released: set[int] = set()
        self.link = Link(self.on_frame, self.lost)
        self.hello = asyncio.get_running_loop().create_future()
        self.ready: str | None = "starting"
        self.pid = 0
        self.streams = 0  # ext_proc streams it forwarded
        self.handoffs = 0  # exchanges it took over
        # Its cyclic collector's totals, as its last W_STATS said, and the answer awaited.
        self.gc_collected = self.gc_uncollectable = 0
        self.stats: asyncio.Future[None] | None = None
        # Told of each token frame's engine and time (``Workers.active``), if set.
        self.on_token: Callable[[EngineState, float], None] | None = None

    def on_frame(self, f: list[Any]) -> None:
        kind = f[0]
        if kind in (W_MSG, W_OPEN):
            call = self.calls.get(f[1])
            if call is None:
                if kind == W_MSG:  # the rest of a stream this side already ended
                    return
                call = self.calls[f[1]] = RemoteCall(self.runtime, RemoteStream(self, f[1]))
                self.streams += 1
            call.on_message(f[2])
            return
        if kind == W_VERDICT:
            self.runtime.router.closes.logged(f[1], f[2])
            return
        if kind == W_STATS:
            self.gc_collected, self.gc_uncollectable = f[1], f[2]
            if self.stats is not None and not self.stats.done():
                self.stats.set_result(None)
            return
        if kind == W_HELLO:
            self.pid = f[1]
            self.push_ready(self.runtime.router.not_ready_reason())  # a restart's too
            if not self.hello.done():
                self.hello.set_result(None)
            return
        if kind == W_CLOSE:  # its stream ended before the worker took the exchange over
            call = self.calls.pop(f[1], None)
            if call is not None:
                call.on_cancel()
            return
        call = self.calls.get(f[1])
        if call is None:
            return
        ex, control = call.driver.ex, self.runtime.router.control
        if kind == W_SERVED:
            control.served_by(ex, f[2])
        elif kind == W_TOKEN:
            control.token(ex, f[2], f[3])
            if self.on_token is not None and ex.engine is not None:
                self.on_token(ex.engine, f[2])
        elif kind == W_FIRST:
            control.first_token(ex, f[2])
        elif kind == W_RELEASE:
            ex.ended_elsewhere(f[2], Outcome(f[3], f[4], f[5], f[6], f[7]))
            self.released.add(f[1])
        elif kind in (W_COUNT, W_CLOSED):  # the worker is done with it
            self.released.discard(f[1])
            if kind == W_COUNT:
                control.count(ex, f[2])
            else:
                control.closed(ex, f[2])
            del self.calls[f[1]]
            call.on_cancel()  # nothing to close any more; its driver leaves the runtime
        self.runtime.drain()

    def finished(self, sid: int, status: int, message: str) -> None:
        if self.calls.pop(sid, None) is not None:
            self.link.send((S_FINISH, sid, status, message))

    async def refresh_stats(self) -> None:
        """Ask the worker for its collector's totals and wait for them (at most
        ``STATS_TIMEOUT_S``: a busy or dying worker leaves its last figures)."""
        if self.link.transport is None:
            return
        if self.stats is None or self.stats.done():
            self.stats = asyncio.get_running_loop().create_future()
            self.link.send((S_STATS,))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.stats), STATS_TIMEOUT_S)

    def push_ready(self, reason: str | None) -> None:
        if reason != self.ready:
            self.ready = reason
            self.link.send((S_READY, reason))

    def lost(self) -> None:
        """The worker is gone, and Envoy's streams with it: close them here."""
        calls, self.calls = self.calls, {}
        for sid, call in calls.items():
            ex = call.driver.ex
            if sid in self.released and ex.terminal is not None:
                self.runtime.router.control.count(ex, ex.terminal)  # as it was released
            call.on_cancel()
        self.released.clear()
        self.runtime.drain()


class Workers:
    """Starts the worker processes, keeps them running, stops them."""

    def __init__(self, runtime: Runtime, config_path: str) -> None:
        self.runtime = runtime
        self.config_path = config_path
        self.n = runtime.router.config.serving.workers
        self.ports: list[WorkerPort | None] = [None] * self.n
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * self.n
        self.stopping = False
        self.started = False  # every worker said hello once
        self.restarts = [0] * self.n
        # (engine name, endpoint) -> the token time last told to the workers
        self.told: dict[tuple[str, str], float] = {}
        runtime.router.listeners.append(self._push_ready)

    async def start(self) -> None:
        for i in range(self.n):
            await self._spawn(i)
        for port in self.ports:
            assert port is not None
            await asyncio.wait_for(asyncio.shield(port.hello), HELLO_TIMEOUT_S)
        self.started = True

    async def _spawn(self, i: int) -> None:
        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-m", "narwhal",
                "--log-level", logging.getLevelName(logging.getLogger().level),
                "worker", "--config", self.config_path, "--index", str(i),
                "--fd", str(theirs.fileno())]
        self.procs[i] = subprocess.Popen(argv, pass_fds=[theirs.fileno()])
        theirs.close()
        port = WorkerPort(self.runtime, i)
        port.on_token = self.active
        port.link.on_lost = functools.partial(self._lost, port)
        self.ports[i] = port
        await asyncio.get_running_loop().connect_accepted_socket(lambda: port.link, ours)

    def _lost(self, port: WorkerPort) -> None:
        WorkerPort.lost(port)
        if self.stopping:
            return
        proc = self.procs[port.index]
        code = None
        if proc is not None:  # its link is gone: it is exiting (let it say why) or hung
            try:
                code = proc.wait(1)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = proc.wait(5)
        if not self.started:  # it never came up: starting it again would not help
            port.hello.set_exception(ConfigError(
                f"serving.workers: worker {port.index} exited before it was ready (exit "
                f"status {code}); its error is in the log above"))
            return
        log.error("worker %d exited (status %s); starting it again", port.index, code)
        self.restarts[port.index] += 1
        loop = asyncio.get_running_loop()
        loop.call_later(RESTART_DELAY_S,
                        lambda: asyncio.ensure_future(self._spawn(port.index)))

    def active(self, e: EngineState, at: float) -> None:
        """A worker relayed a token from ``e`` at ``at``: tell every worker, at most four
        times per stall timeout per engine. Why: before its first token, a request is no
        stall while its engine answers others (``Exchange._stall_end``), and a worker
        sees only its own streams' tokens; a quarter of the timeout keeps what each
        worker knows recent enough, and the frames per engine few (8 a second at the
        0.5 s the tests use, one every 7.5 s at the default 30 s)."""
        key = (e.name, e.endpoint)
        last = self.told.get(key)
        quarter = self.runtime.router.config.serving.engine_stall_timeout_ms / 4000
        if last is not None and at - last < quarter:
            return
        if len(self.told) > 4096:  # engines come and go with discovery
            self.told.clear()
        self.told[key] = at
        for port in self.ports:
            if port is not None:
                port.link.send((S_ACTIVE, e.name, e.endpoint, at))

    def _push_ready(self) -> None:
        reason = self.runtime.router.not_ready_reason()
        for port in self.ports:
            if port is not None:
                port.push_ready(reason)

    def status(self) -> list[dict[str, Any]]:
        """Per worker, for /status and /metrics: up (its link open), pid, streams it
        forwarded, exchanges it took over, streams open, restarts; its process's CPU
        seconds and resident bytes (``/proc``), and its cyclic collector's totals as it
        last told them (``refresh_stats``)."""
        rows = []
        for i, p in enumerate(self.ports):
            cpu, rss = process_usage(p.pid) if p is not None and p.pid else (0.0, 0)
            rows.append({"index": i, "up": p is not None and p.link.transport is not None,
                         "pid": p.pid if p else 0, "streams": p.streams if p else 0,
                         "handoffs": p.handoffs if p else 0, "open": len(p.calls) if p else 0,
                         "restarts": self.restarts[i], "cpu_seconds": cpu, "rss_bytes": rss,
                         "gc_collected": p.gc_collected if p else 0,
                         "gc_uncollectable": p.gc_uncollectable if p else 0})
        return rows

    async def refresh_stats(self) -> None:
        """Every worker's collector totals, fresh (before /metrics or /status answers)."""
        await asyncio.gather(*(p.refresh_stats() for p in self.ports if p is not None))

    async def stop(self) -> None:
        self.stopping = True
        for port in self.ports:
            if port is not None and port.link.transport is not None:
                port.link.transport.close()
        loop = asyncio.get_running_loop()
        for proc in self.procs:
            if proc is None:
                continue
            try:
                await loop.run_in_executor(None, proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()


# -- the worker's side -------------------------------------------------------------------

class RemoteControl(Control):
    """A worker's ``Control``: the shared state lives in the scheduler process; each call
    goes there (and keeps this copy of the exchange consistent with what it reported)."""

    __slots__ = ("link", "sids", "engine_for")

    def __init__(self, router: Router, link: Link,
                 engine_for: Callable[[str, str], EngineState]) -> None:
        super().__init__(router)
        self.link = link
        self.sids: dict[Exchange, int] = {}
        self.engine_for = engine_for

    def served_by(self, ex: Exchange, endpoint: str) -> EngineState | None:
        t, e = ex.ticket, ex.engine
        if (t is None or e is None or t.done or t.first_token_at is not None
                or endpoint == e.endpoint):
            return None
        self.link.send((W_SERVED, self.sids[ex], endpoint))
        moved = next((f for f in t.fallbacks if f.endpoint == endpoint), None)
        ex.engine = t.engine = moved or self.engine_for(endpoint, endpoint)
        t.failover = True
        return ex.engine

    def token(self, ex: Exchange, now: float, first: bool) -> None:
        """The scheduler's step model times the engine's steps from the tokens it sees
        leave them, and here it sees none: each token that comes more than ``MIN_GAP_S``
        after the last one this worker relayed from that engine goes there (every step's
        first token does: the step model's own gap is never shorter), the rest, tokens of
        the same step, do not. So one frame per engine step, not per token, and the
        scheduler's model measures steps as in one process instead of none. (``e`` is
        this worker's copy of the engine: its model only keeps the time of the last token
        here.)"""
        e = ex.engine
        if e is None:
            return
        m = e.model
        last = m.last_step_at
        if last is None or now - last > MIN_GAP_S:
            self.link.send((W_TOKEN, self.sids[ex], now, first))
        m.last_step_at = now

    def first_token(self, ex: Exchange, now: float) -> None:
        t = ex.ticket
        if t is not None and t.first_token_at is None:
            t.first_token_at = now
            self.link.send((W_FIRST, self.sids[ex], now))

    def release(self, ex: Exchange, terminal: str, out: Outcome) -> None:
        if ex.ticket is not None:
            ex.ticket.done = True
        self.link.send((W_RELEASE, self.sids[ex], terminal, out.output_tokens,
                        out.prompt_tokens, out.last_token_at, out.token_id_fault, out.reply))

    def count(self, ex: Exchange, terminal: str) -> None:
        self.link.send((W_COUNT, self.sids[ex], terminal))

    def closed(self, ex: Exchange, now: float) -> None:
        self.link.send((W_CLOSED, self.sids[ex], now))


class WorkerCall:
    """One ext_proc stream in a worker: forwarded to the scheduler until it hands the
    exchange over, then driven here."""

    __slots__ = ("worker", "sid", "stream", "driver", "ended", "opened")

    def __init__(self, worker: Worker, stream: Stream) -> None:
        self.worker = worker
        self.stream = stream
        self.sid = worker.new_sid()
        self.driver: Driver | None = None
        self.ended = False
        self.opened = False  # its first message went to the scheduler
        worker.calls[self.sid] = self
        worker.watch(stream.conn)

    def on_message(self, data: bytes) -> None:
        driver = self.driver
        if driver is None:
            self.worker.link.send((W_MSG if self.opened else W_OPEN, self.sid, data))
            self.opened = True
            return
        try:
            msg = pb.ProcessingRequest.FromString(data)
        except Exception:  # upb raises its own DecodeError type
            self._end()
            self.stream.finish(INVALID_ARGUMENT, "undecodable ProcessingRequest")
            return
        driver.step(_dispatch, driver.ex, msg)

    def on_half_close(self) -> None:
        self._end()
        self.stream.finish()

    def on_cancel(self) -> None:
        self._end()

    # -- from the scheduler --------------------------------------------------------------
    def forwarded(self, data: bytes) -> None:
        self.stream.send(data)
        self.stream.conn.write_soon()

    def finished(self, status: int, message: str) -> None:
        """The scheduler ended the exchange (a refusal, a bad message): it is closed there."""
        self.ended = True
        self.worker.calls.pop(self.sid, None)
        self.stream.finish(status, message)
        self.stream.conn.write_soon()

    def take_over(self, ex: Exchange) -> None:
        self.worker.control.sids[ex] = self.sid
        self.driver = Driver(self.worker.runtime, self._send, self.stream.conn.write_soon, ex)
        self.driver.deliver([])  # its timer: the deadline

    def _send(self, actions: list[Action]) -> None:
        if send_actions(self.stream, actions):
            self.on_half_close()

    def _end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.worker.calls.pop(self.sid, None)
        if self.driver is None:
            if self.opened:
                self.worker.link.send((W_CLOSE, self.sid))
            return
        self.driver.closed()
        self.worker.control.sids.pop(self.driver.ex, None)


class Worker:
    def __init__(self, config: Config, index: int, link: Link) -> None:
        self.config = config
        self.index = index
        self.link = link
        link.on_frame = self.on_frame
        self.router = Router(config)
        self.engines: dict[tuple[str, str], EngineState] = {}
        self.control = RemoteControl(self.router, link, self.engine_for)
        self.router.control = self.control
        self.runtime = Runtime(self.router, asyncio.get_running_loop())
        self.calls: dict[int, WorkerCall] = {}
        self.sids = 0
        self.ready: str | None = "starting"
        self.health = HealthRegistry(self.health_status)
        # Envoy's connections, held back while the link to the scheduler is full (what
        # they send is forwarded there): a slow scheduler bounds what a worker buffers.
        self.conns: weakref.WeakSet[GrpcConnection] = weakref.WeakSet()
        self.full = False
        link.on_full = self.link_full

    def link_full(self, full: bool) -> None:
        self.full = full
        for conn in list(self.conns):
            conn.hold(full)

    def watch(self, conn: GrpcConnection) -> None:
        if conn not in self.conns:
            self.conns.add(conn)
            if self.full:
                conn.hold(True)

    def new_sid(self) -> int:
        self.sids += 1
        return self.sids

    def engine_for(self, name: str, endpoint: str) -> EngineState:
        """An engine to name in this worker's exchanges (the scheduler's pool has the
        state; here only its name and endpoint are read)."""
        key = (name, endpoint)
        e = self.engines.get(key)
        if e is None:
            if len(self.engines) > 4096:
                self.engines.clear()
            e = self.engines[key] = EngineState.from_config(
                EngineConfig(name=name, url=f"http://{endpoint}"))
        return e

    def health_status(self, service: str) -> int | None:
        """The scheduler's readiness, as last pushed (S_READY)."""
        return serving_status(service, lambda: self.ready)

    def on_frame(self, f: list[Any]) -> None:
        kind = f[0]
        if kind == S_READY:
            self.ready = f[1]
            self.health.refresh()
            return
        if kind == S_STATS:
            totals = gc.get_stats()
            self.link.send((W_STATS, sum(g["collected"] for g in totals),
                            sum(g["uncollectable"] for g in totals)))
            return
        if kind == S_ACTIVE:  # another worker's stream got a token from the engine
            m = self.engine_for(f[1], f[2]).model
            if m.last_step_at is None or f[3] > m.last_step_at:
                m.last_step_at = f[3]
            return
        call = self.calls.get(f[1])
        if call is None:  # its stream ended meanwhile (the scheduler closed it there)
            return
        if kind == S_SEND:
            call.forwarded(f[2])
        elif kind == S_FINISH:
            call.finished(f[2], f[3])
        elif kind == S_HANDOFF:
            call.take_over(resume(self.router, f[2], self.engine_for))

    def routes(self) -> dict[bytes, Callable[[Stream], Any]]:
        return {PROCESS_PATH: functools.partial(WorkerCall, self),
                CHECK_PATH: self.health.check_call, WATCH_PATH: self.health.watch_call,
                ACCESS_LOG_PATH: functools.partial(AccessLogCall, self.verdict)}

    def verdict(self, request_id: str, verdict: str) -> None:
        self.link.send((W_VERDICT, request_id, verdict))


async def run_worker(config: Config, index: int, fd: int) -> None:
    from .app import listen_grpc, start_tracer, stop_tracer
    from .loop import started

    loop = asyncio.get_running_loop()
    gone = loop.create_future()

    def lost() -> None:
        if not gone.done():
            gone.set_result(None)

    link = Link(lambda f: None, lost)
    worker = Worker(config, index, link)  # before the link reads: it takes every frame
    await loop.connect_accepted_socket(lambda: link, socket.socket(fileno=fd))
    stop = await listen_grpc(config.serving, worker.routes(), None, worker_socket(config, index))
    for sig in (signal.SIGTERM, signal.SIGINT):  # the scheduler decides when workers stop
        loop.add_signal_handler(sig, lambda: None)
    tracer = start_tracer(config)  # the exchanges' records are made here
    started()
    link.send((W_HELLO, os.getpid()))
    await gone  # the scheduler closed the link (it drained) or died
    await stop()
    stop_tracer(tracer)


def main(config: Config, index: int, fd: int) -> None:
    from .loop import install_uvloop

    install_uvloop()
    asyncio.run(run_worker(config, index, fd))
