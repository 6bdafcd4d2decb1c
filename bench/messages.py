"""Per-message cost of Narwhal's ext_proc server path, in process, without sockets.

    python -m bench.messages [--events N | --requests N [--engines P,Q | --prompt-bytes B,C
                                                        | --clients C [--wide-slots]]]
                             [--reps R] [--opcodes | --by-message | --instructions
                                         | --decisions]

An ``h2`` client opens one ext_proc stream on a ``GrpcConnection`` (Narwhal's HTTP/2 and
gRPC layers, the ext_proc adapter, the driver and the exchange, as served), takes a
streaming chat request to its response body, then feeds N response-body messages of one
token event each, one per ``data_received`` (the worst case: no two messages share a
read). With ``--requests N`` it instead feeds N whole non-streaming requests, each on
its own ext_proc stream as Envoy opens one per request: headers, body, the engine's
response headers, eight body chunks of two token events, the end (admission,
placement, learning and assembly included). It prints the median over R runs. Kernel, event-loop and Envoy
costs are not in it, which is the point: it isolates what Narwhal's own Python costs per
token event, for profiling (``python -m cProfile -m bench.messages``) and before/after
comparisons of the hot path. ``make bench`` measures the whole data path.

``--instructions`` counts the machine instructions the process executes per unit, under
valgrind (``cachegrind``, ~50x slower): C code (protobuf, orjson, the interpreter) and the
cyclic garbage collector included, and repeatable within ~1.5% (the models learn from a
clock valgrind slows) where timings on this shared machine move by 5-10% between runs.
Both runs make the client's bytes of 2N units and feed N or 2N of them; their counts are
differenced, so start-up and the client's own work are left out. Like any count, not a
time, but the one closest to CPU time that a noisy machine cannot move.

``--decisions`` splits a request's time between the router's decisions (the calls the
exchange makes into admission, placement, the queue, learning and accounting: the
scheduler's state, which any data path, compiled or not, has to consult) and the rest,
the data path: what a compiled data path in front of the same decisions could save.

``--opcodes`` counts the bytecode instructions the interpreter executes per unit instead
of timing it (``sys.settrace`` with opcode events, so ~50x slower), by module and
function: where the interpreter's work is, in a count that does not move with this
machine's noise (medians of times move by 5-10% between runs) and without cProfile's
per-call overhead, which inflates call-heavy code. It is not a measure of time: a change
that trades bytecode for C calls that allocate can count less and cost more (measured:
a set difference per token event in the assembler, -35% of its instructions, +7% of its
time), so changes are judged by time, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from narwhal.config import parse
from narwhal.core.accounting import Accounting
from narwhal.core.control import Control
from narwhal.core.exchange import Phase
from narwhal.core.router import Router
from narwhal.core.scheduler import Scheduler
from narwhal.core.sizing import Sizer
from narwhal.server.driver import Runtime
from narwhal.server.extproc import PROCESS_PATH, ExtProcCall
from narwhal.server.grpc_server import GrpcConnection


class Transport:
    """What the connection writes, kept for the client."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _message(req: pb.ProcessingRequest) -> bytes:
    body = req.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def _headers(values: dict[str, str]) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]))


class Opcodes:
    """Bytecode instructions executed while active, by code object."""

    def __init__(self) -> None:
        self.counts: collections.Counter[CodeType] = collections.Counter()

    def _local(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "opcode":
            self.counts[frame.f_code] += 1
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        frame.f_trace_opcodes = True
        return self._local

    def __enter__(self) -> None:
        sys.settrace(self._global)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)

    def report(self, units: int, unit: str, top: int = 12) -> None:
        by_module: collections.Counter[str] = collections.Counter()
        by_function: collections.Counter[str] = collections.Counter()
        for code, n in self.counts.items():
            name = code.co_filename
            module = name.split("/narwhal/")[-1] if "/narwhal/" in name else name.rsplit("/", 1)[-1]
            by_module[module] += n
            by_function[f"{module}:{code.co_name}"] += n
        total = sum(by_module.values())
        print(f"{total / units:.0f} bytecode instructions per {unit}")
        for title, counter in (("modules", by_module), ("functions", by_function)):
            print(f"  by {title}:")
            for name, n in counter.most_common(top):
                print(f"    {name:48s} {n / units:8.0f}  {n / total * 100:5.1f}%")


class Decisions:
    """Time a request spends in the router's decisions, the calls the exchange makes into
    it (admission and placement, the queue, learning, accounting), outermost calls only;
    the rest of the request is the data path (HTTP/2, gRPC, protobuf, the exchange, SSE,
    metering, assembly). Why: whether a compiled data path in front of these decisions,
    kept in Python, could meet the data-path targets. Installed on the classes for one
    run, counted while measured requests are fed."""

    ENTRY_POINTS = ((Scheduler, "admit"), (Scheduler, "annotate"), (Scheduler, "prompt_facts"),
                    (Sizer, "estimate"), (Accounting, "offer"), (Router, "not_ready_reason"),
                    (Router, "pump"), (Control, "served_by"), (Control, "token"),
                    (Control, "first_token"), (Control, "release"), (Control, "count"),
                    (Control, "closed"))

    def __init__(self) -> None:
        self.calls = 0
        self.by_entry: collections.Counter[str] = collections.Counter()  # seconds
        self.inside = False
        self.active = False

    @property
    def seconds(self) -> float:
        return sum(self.by_entry.values())

    def _wrap(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.inside or not self.active:
                return method(*args, **kwargs)
            self.inside = True
            self.calls += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.by_entry[name] += time.perf_counter() - start
                self.inside = False
        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[Decisions]:
        saved = [(cls, name, cls.__dict__[name]) for cls, name in self.ENTRY_POINTS]
        for cls, name, method in saved:
            setattr(cls, name, self._wrap(method, f"{cls.__name__}.{name}"))
        try:
            yield self
        finally:
            for cls, name, method in saved:
                setattr(cls, name, method)

    def __enter__(self) -> None:
        self.active = True

    def __exit__(self, *exc: object) -> None:
        self.active = False


WAITING = (Phase.REQUEST_BODY, Phase.MEASURING, Phase.QUEUED)  # a --clients request not yet upstream

# Set by --opcodes: the measured loops run under it instead of being timed.
COUNT: Opcodes | None = None
# Set by --decisions: the measured loops are timed, and the decisions within them.
DECIDING: Decisions | None = None


def _feed(conn: GrpcConnection, reads: list[bytes], measured: bool = True) -> float:
    """Feed the reads; their time, or 0 when not measured or counting instructions."""
    timed = measured and COUNT is None
    active = COUNT if COUNT is not None else DECIDING
    counting = active if measured and active is not None else contextlib.nullcontext()
    start = time.perf_counter()
    with counting:
        for data in reads:
            conn.data_received(data)
    return time.perf_counter() - start if timed else 0.0


# Phase slots wide enough that every client's request is in flight at once, as it is
# through Envoy alone (--wide-slots here, the "wide" configuration of bench.datapath).
WIDE = {"max_prefill_per_engine": 128, "max_decode_per_engine": 256}


async def setup(engines: int = 1, scheduler: dict | None = None
                ) -> tuple[GrpcConnection, Transport, h2.connection.H2Connection, Router]:
    router = Router(parse({
        "engines": [{"name": f"e{i}", "url": f"http://127.0.{i // 250}.{i % 250 + 1}:9"}
                    for i in range(engines)],
        "scheduler": scheduler or {},
        # A run that outlasts the staleness window (under a profiler) would be refused
        # "monitoring-degraded" and measure refusals: nothing scrapes here.
        "telemetry": {"profiling": False, "stale_after_ms": 86_400_000}}))
    for e in router.engines:
        e.healthy = e.checked = True
        e.telemetry_at = router.clock()
    router.started = True
    conn = GrpcConnection({PROCESS_PATH: functools.partial(
        ExtProcCall, Runtime(router, asyncio.get_running_loop()))})
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                   header_encoding=None))
    client.initiate_connection()
    client.increment_flow_control_window(2**30)
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**30})

    exchange_bytes(conn, transport, client)
    return conn, transport, client, router


def exchange_bytes(conn: GrpcConnection, transport: Transport,
                   client: h2.connection.H2Connection) -> None:
    conn.data_received(client.data_to_send())
    for data in transport.out:
        for ev in client.receive_data(data):
            if isinstance(ev, h2.events.DataReceived):
                client.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
    transport.out.clear()


def open_stream(client: h2.connection.H2Connection) -> int:
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, [(":method", "POST"), (":scheme", "http"),
                              (":path", PROCESS_PATH.decode()), (":authority", "narwhal"),
                              ("content-type", "application/grpc"), ("te", "trailers")])
    return sid


def token_event(text: str, token: int, finish: str | None = None) -> bytes:
    event = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "narwhal-sim",
             "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                          "finish_reason": finish, "token_ids": [token]}]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


async def run(events: int, fed: int | None = None) -> float:
    """Seconds per token event; ``fed``: only that many of the events made are fed
    (``--only``)."""
    conn, transport, client, _ = await setup()
    sid = open_stream(client)
    body = orjson.dumps({"model": "narwhal-sim", "stream": True, "max_tokens": 1_000_000,
                         "messages": [{"role": "user", "content": "hi"}]})
    for req in (
            pb.ProcessingRequest(request_headers=_headers(
                {":path": "/v1/chat/completions", ":method": "POST"})),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
            pb.ProcessingRequest(response_headers=_headers(
                {":status": "200", "content-type": "text/event-stream"}))):
        client.send_data(sid, _message(req))
    exchange_bytes(conn, transport, client)
    chunk = token_event("tok", 42)
    message = _message(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)))
    reads = []
    for _ in range(events):  # the client's own cost stays out of the timing
        client.send_data(sid, message)
        reads.append(client.data_to_send())
    if fed is not None:
        _feed(conn, reads[:fed], False)
        return 0.0
    elapsed = _feed(conn, reads)
    replies = sum(len(x) for x in transport.out)
    if replies < events * len(chunk):
        raise SystemExit(f"only {replies} reply bytes for {events} events: not relayed")
    return elapsed / events


def request_body(prompt_bytes: int = 0) -> bytes:
    """The client's body: "hello there", or a prompt of about ``prompt_bytes`` bytes of
    words (what a request's own bytes cost: parsing, sizing, the prefix index's blocks,
    the upstream rewrite; real chat prompts run to kilobytes)."""
    words = ("the quick brown fox jumps over a lazy dog 0123 " * (prompt_bytes // 47 + 1)
             )[:prompt_bytes] if prompt_bytes else "hello there"
    return orjson.dumps({"model": "narwhal-sim", "max_tokens": 16,
                         "messages": [{"role": "user", "content": words}]})


def request_reads(client: h2.connection.H2Connection, chunks: int,
                  body: bytes) -> list[bytes]:
    """One non-streaming request as Envoy sends it, one read per message: headers, body,
    the engine's response headers, ``chunks`` body chunks of two token events each (the
    last with the usage event and ``[DONE]``), the end of the body, the end of the stream."""
    sid = open_stream(client)
    reads = []

    def send(req: pb.ProcessingRequest, end: bool = False) -> None:
        data, size = _message(req), client.max_outbound_frame_size
        for at in range(0, len(data), size):  # a large body's message spans frames
            client.send_data(sid, data[at:at + size], end_stream=end and at + size >= len(data))
        reads.append(client.data_to_send())

    send(pb.ProcessingRequest(request_headers=_headers(
        {":path": "/v1/chat/completions", ":method": "POST",
         "content-type": "application/json", "x-request-id": f"r{sid}"})))
    send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    send(pb.ProcessingRequest(response_headers=_headers(
        {":status": "200", "content-type": "text/event-stream"})))
    for i in range(chunks):
        last = i == chunks - 1
        body = token_event("a", 2 * i + 1) + token_event("b", 2 * i + 2, "length" if last else None)
        if last:
            usage = {"id": "c", "object": "chat.completion.chunk", "created": 1,
                     "model": "narwhal-sim", "choices": [],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 2 * chunks,
                               "total_tokens": 5 + 2 * chunks}}
            body += b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n"
        send(pb.ProcessingRequest(response_body=pb.HttpBody(body=body)))
    send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)), end=True)
    return reads


async def run_requests(requests: int, warm: int = 0, engines: int = 1,
                       prompt_bytes: int = 0) -> float:
    """Whole non-streaming requests, each on its own ext_proc stream, one after another,
    to a pool of ``engines``; the first ``warm`` of them are not measured."""
    conn, transport, client, router = await setup(engines)
    body = request_body(prompt_bytes)
    total = 0.0
    for i in range(warm + requests):
        reads = request_reads(client, 8, body)
        total += _feed(conn, reads, i >= warm)
        exchange_bytes(conn, transport, client)
    if conn.streams:
        raise SystemExit(f"{len(conn.streams)} ext_proc streams still open")
    placed = sum(e.dispatched for e in router.engines)
    if placed != warm + requests:
        raise SystemExit(f"{warm + requests - placed} of {warm + requests} "
                         "requests not placed: the run measured refusals")
    return total / requests


async def fed_requests(requests: int, fed: int, engines: int = 1, prompt_bytes: int = 0
                       ) -> None:
    """``--only``: the client's bytes of ``requests`` requests made first, then only ``fed``
    of them fed, their replies never read (the windows are wide enough): two runs that
    differ in ``fed`` alone differ in Narwhal's work alone."""
    conn, transport, client, router = await setup(engines)
    body = request_body(prompt_bytes)
    reads = [request_reads(client, 8, body) for _ in range(requests)]
    for request in reads[:fed]:
        _feed(conn, request, False)
        transport.out.clear()
    if conn.streams or sum(e.dispatched for e in router.engines) != fed:
        raise SystemExit("a request fed was not placed and answered")


async def run_clients(requests: int, clients: int, wide: bool = False) -> float:
    """``clients`` non-streaming requests open at once, in a closed loop against one
    engine: past the default 4 prefill slots the rest queue, so this measures the queue
    path too (joins, pumps at first tokens and releases, dispatches from the queue, their
    re-projections), unless ``wide`` gives every client a slot. Each client feeds its
    next message once its request is out of the queue; as many unmeasured requests as
    measured come first. Seconds per request."""
    conn, transport, client, router = await setup(1, WIDE if wide else None)
    body = request_body()
    total, done = 0.0, 0
    open_: list[tuple[int, list[bytes]]] = []

    def start() -> tuple[int, list[bytes]]:
        reads = request_reads(client, 8, body)
        sid = client.highest_outbound_stream_id
        feed(reads[:2])  # its headers and body: admitted, queued or placed
        return sid, reads[2:]

    def feed(reads: list[bytes]) -> None:
        nonlocal total
        total += _feed(conn, reads, done >= requests)

    for _ in range(clients):
        open_.append(start())
    exchange_bytes(conn, transport, client)
    while done < 2 * requests:
        moved = False
        for k, (sid, rest) in enumerate(open_):
            st = conn.streams.get(sid)
            call = st.call if st is not None else None
            if isinstance(call, ExtProcCall) and call.driver.ex.phase in WAITING:
                continue  # in the queue: the engine has nothing of it yet
            feed([rest.pop(0)])
            moved = True
            if not rest:
                done += 1
                open_[k] = start()
            exchange_bytes(conn, transport, client)
        await asyncio.sleep(0)  # what the loop runs between reads (write_soon's flushes)
        if not moved:
            raise SystemExit("every client waits in the queue: nothing frees a slot")
    return total / requests


def instructions(unit_args: list[str], n: int) -> float:
    """Machine instructions per unit: this benchmark run under cachegrind twice, each
    making the client's bytes of ``2 n`` units and feeding ``n`` or ``2 n`` of them
    (``--only``), differenced: what is left is Narwhal's work on ``n`` units."""
    counts = []
    for k in (n, 2 * n):
        run_ = subprocess.run(
            ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
             sys.executable, "-m", "bench.messages", *unit_args, str(2 * n), "--only", str(k)],
            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True)
        found = re.search(r"I\s+refs:\s+([\d,]+)", run_.stderr)
        if run_.returncode or found is None:
            raise SystemExit(f"valgrind run failed: {run_.stderr[-2000:]}")
        counts.append(int(found.group(1).replace(",", "")))
    return (counts[1] - counts[0]) / n


MESSAGES = ("request headers", "request body", "response headers",
            *(f"response chunk {i + 1}" for i in range(8)), "end of response")


async def by_message(requests: int, engines: int = 1, prompt_bytes: int = 0
                     ) -> list[float]:
    """Median seconds of each of a request's 12 messages (``MESSAGES``) over ``requests``
    requests, after as many unmeasured: where a request's cost is (the first token's
    learning falls in the first chunk, completion and the assembled answer in the end)."""
    conn, transport, client, _ = await setup(engines)
    body = request_body(prompt_bytes)
    times: list[list[float]] = [[] for _ in MESSAGES]
    for i in range(2 * requests):
        for k, data in enumerate(request_reads(client, 8, body)):
            elapsed = _feed(conn, [data])
            if i >= requests:
                times[k].append(elapsed)
        exchange_bytes(conn, transport, client)
    return [statistics.median(t) for t in times]


def alternated(requests: int, cases: list[tuple[int, int]], reps: int
               ) -> dict[tuple[int, int], list[float]]:
    """Seconds per request for each (pool size, prompt bytes), ``reps`` runs each; the cases
    alternate within each repetition, so that a slow spell of this machine falls on all
    alike."""
    runs: dict[tuple[int, int], list[float]] = {c: [] for c in cases}
    for _ in range(reps):
        for engines, prompt in cases:
            runs[engines, prompt].append(asyncio.run(run_requests(
                requests, engines=engines, prompt_bytes=prompt)))
    return runs


def decisions(requests: int, engines: int, reps: int
              ) -> tuple[float, float, float, dict[str, float]]:
    """Seconds per request, seconds of it in the router's decisions, the calls into them
    and the seconds by entry point (``Decisions``): medians of ``reps`` pairs of runs, one
    plain (the request's time, undisturbed by the timing of each call) and one with the
    decisions timed, alternated."""
    global DECIDING
    whole, deciding, calls = [], [], []
    entries: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(reps):
        whole.append(asyncio.run(run_requests(requests, warm=requests, engines=engines)))
        DECIDING = Decisions()
        try:
            with DECIDING.installed():
                asyncio.run(run_requests(requests, warm=requests, engines=engines))
            deciding.append(DECIDING.seconds / requests)
            calls.append(DECIDING.calls / requests)
            for name, seconds in DECIDING.by_entry.items():
                entries[name].append(seconds / requests)
        finally:
            DECIDING = None
    by_entry = {name: statistics.median(v) for name, v in entries.items()}
    return (statistics.median(whole), statistics.median(deciding), statistics.median(calls),
            by_entry)


def slope(runs: dict[int, list[float]]) -> float:
    """Seconds each unit of a case adds to a request, from its smallest to its largest:
    each engine of the pool (admission and placement project every serviceable engine),
    or each byte of the prompt."""
    lo, hi = min(runs), max(runs)
    return (statistics.median(runs[hi]) - statistics.median(runs[lo])) / (hi - lo)


def main() -> int:
    global COUNT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=0,
                        help="measure whole non-streaming requests instead of token events")
    parser.add_argument("--engines", default="1",
                        help="with --requests: pool sizes, comma-separated (admission and "
                             "placement project every engine: their cost grows with the pool)")
    parser.add_argument("--prompt-bytes", default="0",
                        help="with --requests: prompt sizes in bytes, comma-separated (0: "
                             "'hello there'); with several, the cost of each byte")
    parser.add_argument("--opcodes", action="store_true",
                        help="count bytecode instructions per unit (after as many unmeasured "
                             "requests as measured) instead of timing")
    parser.add_argument("--clients", type=int, default=0,
                        help="with --requests: this many requests open at once in a closed "
                             "loop against one engine (past its 4 prefill slots they queue)")
    parser.add_argument("--wide-slots", action="store_true",
                        help="with --clients: slots for every client (no queue)")
    parser.add_argument("--by-message", action="store_true",
                        help="with --requests: each message's median time instead of the "
                             "request's")
    parser.add_argument("--instructions", action="store_true",
                        help="count machine instructions per unit under valgrind instead of "
                             "timing (C code and the garbage collector included)")
    parser.add_argument("--decisions", action="store_true",
                        help="with --requests: the share of a request's time spent in the "
                             "router's decisions (admission, placement, the queue, learning, "
                             "accounting), the rest being the data path")
    parser.add_argument("--only", type=int, default=0, help=argparse.SUPPRESS)  # valgrind's run
    args = parser.parse_args()
    if (args.by_message or args.clients or args.decisions) and not args.requests:
        parser.error("--by-message, --clients and --decisions measure --requests")
    if args.decisions and (args.by_message or args.clients or args.opcodes
                           or args.instructions or args.prompt_bytes != "0"):
        parser.error("--decisions times whole requests to pools of --engines on its own")
    if args.clients and (args.by_message or args.engines != "1" or args.prompt_bytes != "0"):
        parser.error("--clients runs one engine and 'hello there' on its own")
    if args.requests:
        n, flag = args.requests, "--requests"
        unit = "non-streaming request of 16 tokens in 8 chunks, 12 messages"
    else:
        n, flag, unit = args.events, "--events", "token-event message"
    pools = [int(x) for x in args.engines.split(",")]
    prompts = [int(x) for x in args.prompt_bytes.split(",")]
    if len(pools) > 1 and len(prompts) > 1:
        parser.error("vary --engines or --prompt-bytes, not both")
    if args.only:  # one run under valgrind (``instructions``): n units made, --only fed
        if args.requests:
            asyncio.run(fed_requests(n, args.only, pools[0], prompts[0]))
        else:
            asyncio.run(run(n, args.only))
        return 0
    if args.instructions:
        if args.clients or args.by_message or len(pools) > 1 or len(prompts) > 1:
            parser.error("--instructions counts one case of --requests or --events")
        if shutil.which("valgrind") is None:
            parser.error("--instructions needs valgrind (Debian: apt-get install valgrind)")
        unit_args = (["--engines", str(pools[0]), "--prompt-bytes", str(prompts[0]),
                      "--requests"] if args.requests else ["--events"])
        count = instructions(unit_args, n)
        print(f"ext_proc server path, in process, under valgrind: {count:,.0f} machine "
              f"instructions per {unit} (runs of {n} and {2 * n}, differenced)")
        print(f"reproduce: python -m bench.messages {flag} {n}"
              f"{f' --engines {pools[0]} --prompt-bytes {prompts[0]}' if args.requests else ''}"
              " --instructions")
        return 0
    slots = "wide slots" if args.wide_slots else "default slots"
    again = (f"python -m bench.messages --requests {n} --clients {args.clients}"
             f"{' --wide-slots' if args.wide_slots else ''}")
    if args.opcodes:
        COUNT = Opcodes()
        if args.clients:
            asyncio.run(run_clients(n, args.clients, args.wide_slots))
            COUNT.report(n, f"request ({args.clients} clients, {slots})")
            print(f"reproduce: {again} --opcodes")
            return 0
        if args.requests:
            asyncio.run(run_requests(n, warm=n, engines=pools[0], prompt_bytes=prompts[0]))
        else:
            asyncio.run(run(n))
        COUNT.report(n, unit)
        print(f"reproduce: python -m bench.messages {flag} {n} --opcodes")
        return 0
    if args.clients:
        runs = [asyncio.run(run_clients(n, args.clients, args.wide_slots))
                for _ in range(args.reps)]
        print(f"ext_proc server path, in process, {args.clients} clients in a closed loop, one "
              f"engine, {slots}: {statistics.median(runs) * 1e6:.2f} us per {unit} (median "
              f"of {args.reps} x {n}; min {min(runs) * 1e6:.2f})")
        print(f"reproduce: {again} --reps {args.reps}")
        return 0
    if args.by_message:
        medians = asyncio.run(by_message(n, pools[0], prompts[0]))
        print(f"ext_proc server path, in process, {pools[0]} engine(s), prompt "
              f"{prompts[0] or 'hello there'}: median us per message of {n} requests")
        for name, t in zip(MESSAGES, medians, strict=True):
            print(f"  {name:18s} {t * 1e6:8.1f}")
        print(f"  {'sum':18s} {sum(medians) * 1e6:8.1f}")
        print(f"reproduce: python -m bench.messages --requests {n} --engines {pools[0]} "
              f"--prompt-bytes {prompts[0]} --by-message")
        return 0
    if not args.requests:
        runs = [asyncio.run(run(n)) for _ in range(args.reps)]
        print(f"ext_proc server path, in process: {statistics.median(runs) * 1e6:.2f} us per "
              f"{unit} (median of {args.reps} x {n}; min {min(runs) * 1e6:.2f})")
        print(f"reproduce: python -m bench.messages --events {n} --reps {args.reps}")
        return 0
    if args.decisions:
        for p in pools:
            whole, deciding, calls, by_entry = decisions(n, p, args.reps)
            print(f"ext_proc server path, in process, {p} engine{'s' if p > 1 else ''}: "
                  f"{whole * 1e6:.2f} us per {unit}, of which the router's decisions "
                  f"{deciding * 1e6:.2f} us ({deciding / whole:.0%}, {calls:.0f} calls) and "
                  f"the data path {(whole - deciding) * 1e6:.2f} us (medians of {args.reps} "
                  f"x {n})")
            print("  " + ", ".join(f"{name} {seconds * 1e6:.1f}" for name, seconds in
                                   sorted(by_entry.items(), key=lambda kv: -kv[1])))
        print(f"reproduce: python -m bench.messages --requests {n} --engines {args.engines} "
              f"--reps {args.reps} --decisions")
        return 0
    cases = [(p, b) for p in pools for b in prompts]
    runs_by = alternated(n, cases, args.reps)
    for p, b in cases:
        runs = runs_by[p, b]
        prompt = f", a {b}-byte prompt" if b else ""
        print(f"ext_proc server path, in process, {p} engine{'s' if p > 1 else ''}{prompt}: "
              f"{statistics.median(runs) * 1e6:.2f} us per {unit} (median of "
              f"{args.reps} x {n}; min {min(runs) * 1e6:.2f})")
    if len(pools) > 1:
        per = slope({p: runs_by[p, prompts[0]] for p in pools})
        print(f"each engine of the pool adds {per * 1e6:.2f} us per request "
              f"({min(pools)} to {max(pools)} engines)")
    if len(prompts) > 1:
        per = slope({b: runs_by[pools[0], b] for b in prompts})
        print(f"each KB of prompt adds {per * 1e9:.2f} us per request "
              f"({min(prompts)} to {max(prompts)} bytes)")
    print(f"reproduce: python -m bench.messages --requests {n} --engines {args.engines} "
          f"--prompt-bytes {args.prompt_bytes} --reps {args.reps}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
