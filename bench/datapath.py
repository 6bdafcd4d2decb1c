"""Data-path benchmark: what Narwhal costs next to the proxy it sits in and a peer router,
side by side in one run.

    python -m bench.datapath [--duration S] [--reps N] [--connections C]
                             [--configs default,wide,workers2,null,cnull]
                             [--transport asyncio|grpcio]
                             [--plot PATH]

Paths (each Narwhal stack and null processor against a simulator of its own, of the same
kind; Envoy alone and the peer against the first stack's):
  envoy        Envoy alone, proxying to the simulator (bench/envoy-direct.yaml)
  vllm-router  the PyPI Rust router users pick instead (round robin over one engine)
  narwhal      Envoy + Narwhal over a Unix socket (the chart's sidecar default), per
               config: ``default`` (the shipped scheduler settings: 4 prefill slots per
               engine, requests beyond them queue in Narwhal), ``wide`` (slots wide enough
               for every client, as through Envoy alone) and ``workers2`` (the default
               with ``serving.workers: 2``: the scheduler process and two workers; the
               scheduler's own CPU is also reported on its own)
  null-processor  Envoy + ``bench.null_extproc`` (``--configs null``): Narwhal's transport
               answering every message with no logic, the floor of any Python processor
               in Narwhal's place (its CPU in the ``narwhal`` column)
  null-compiled  Envoy + ``bench/null_extproc.c`` (``--configs cnull``): the same
               processor in C on nghttp2, the floor of any processor, and what Envoy
               itself costs beside one that costs almost nothing

Workloads: (a) 16-token chat completions against an instant engine, non-streaming and
streaming, ``--connections`` wrk connections; (b) paced streams, 5 ms per token x 64
tokens x 64 clients. For each path: requests (or token events) per second and the CPU
time of each of its processes per request (per event), from /proc utime+stime: the load
generator is not charged, and the simulator's CPU is its own ``engine`` column, apart from
the path's whole. Runs alternate between paths and medians are reported, because a
2-core machine is noisy. Ratios are to Envoy alone's CPU in the same run. After the floor
lines, the engine's stream: every path's non-streaming rate against Envoy alone's
streaming one (Narwhal asks the engine for a stream to assemble the answer).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import yaml

from bench import messages, null_extproc, scratch, vllm_router, vllm_router_exe
from narwhal.launch import (
    REPO_ROOT,
    SimSpec,
    Stack,
    envoy_binary,
    free_port,
    plain_envoy,
    render_envoy,
    wait_http,
)

CLK_TCK = os.sysconf("SC_CLK_TCK")
MODEL = "narwhal-sim"
PACED_TOKENS = 64
PACED_CLIENTS = 64
NULLS = ("null", "cnull")  # configs that are a null processor, not Narwhal


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def running(pid: int) -> bool:
    """The process exists and has not exited (an exited child not yet reaped keeps its
    final CPU in ``/proc``: charged, it would read as costing nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def ext_proc_messages(admin: int) -> int:
    """The ext_proc messages Envoy has sent to its processor and received from it (its
    ``stream_msgs_sent`` and ``stream_msgs_received``)."""
    url = f"http://127.0.0.1:{admin}/stats?filter=ext_proc.stream_msgs_"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return sum(int(line.rsplit(":", 1)[1]) for line in reply.read().decode().splitlines()
                   if line.strip())


def io_calls(pid: int) -> int:
    """Read- and write-type system calls the process has made (``/proc/PID/io``): how
    many messages each socket read and write carries, which is what sets the per-event
    cost of the event loop."""
    calls = 0
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith(("syscr:", "syscw:")):
            calls += int(line.split()[1])
    return calls


def _tree(pid: int, own: Callable[[int], float]) -> float:
    """``own`` summed over a process and its children (vllm-router's launcher runs the
    router; Narwhal's scheduler starts its workers)."""
    total = own(pid)
    for child in Path(f"/proc/{pid}/task").glob("*/children"):
        for c in child.read_text().split():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += _tree(int(c), own)
    return total


def tree_cpu(pid: int) -> float:
    return _tree(pid, cpu_seconds)


@dataclass
class Route:
    """One way from the client to the engine: its URL and the processes charged."""

    name: str
    url: str
    pids: dict[str, int]  # role -> pid (its CPU with its children's)
    stop: Callable[[], None]
    alone: frozenset[str] = frozenset()  # roles charged without their children
    rps: list[float] = field(default_factory=list)
    cpu_us: dict[str, list[float]] = field(default_factory=dict)  # role -> per unit
    syscalls: dict[str, list[float]] = field(default_factory=dict)  # role -> per unit
    errors: int = 0
    envoy_admin: int = 0  # an Envoy with ext_proc in its path: its admin port
    messages: list[float] = field(default_factory=list)  # ext_proc messages per unit


def wrk(url: str, body: dict, seconds: float, connections: int, workdir: Path
        ) -> tuple[int, float, int]:
    script = workdir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {orjson.dumps(orjson.dumps(body).decode()).decode()}\n"
        'wrk.headers["Content-Type"] = "application/json"\n')
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
                          "-s", str(script), url], capture_output=True, text=True, check=True)
    text = out.stdout
    count = int(re.search(r"(\d+) requests in", text).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    return count, rps, int(bad.group(1)) if bad else 0


def start_paths(sim: SimSpec, configs: list[str], transport: str, workdir: Path,
                peer: bool) -> list[Route]:
    paths: list[Route] = []
    stacks = {}
    for cfg in (c for c in configs if c not in NULLS):
        serving: dict = {"transport": transport,
                         "extproc_socket": str(Path(tempfile.mkdtemp(prefix="nw-")) / "x.sock")}
        if cfg == "workers2":
            serving["workers"] = 2
        # A simulator of its own (a copy of the spec: a shared one keeps the first stack's
        # port, and the next stack's simulator would fail to bind it while the first one
        # answered every stack).
        stack = Stack(sims=[dataclasses.replace(sim, port=0)], model=MODEL,
                      config={"serving": serving,
                              "scheduler": messages.WIDE if cfg == "wide" else {}}).start()
        stacks[cfg] = stack
    # Envoy alone and the peer proxy to the first stack's simulator.
    first = next(iter(stacks.values()))
    sim_port, sim_pid = first.sims[0].port, engine_pid(first)
    paths.append(envoy_alone(sim_port, workdir, sim_pid))
    if peer:
        router, router_port = vllm_router([f"http://127.0.0.1:{sim_port}"], "round_robin",
                                          workdir)

        def stop_router() -> None:
            router.terminate()
            router.wait()

        paths.append(Route("vllm-router", f"http://127.0.0.1:{router_port}",
                           {"vllm-router": router.pid, "engine": sim_pid}, stop_router))
    paths += [null_path(sim, workdir, compiled=c == "cnull") for c in configs if c in NULLS]
    for cfg, stack in stacks.items():
        pid = stack.proc("narwhal").popen.pid
        pids = {"envoy": stack.proc("envoy").popen.pid, "narwhal": pid,
                "engine": engine_pid(stack)}
        if cfg == "workers2":  # narwhal: the scheduler and its workers; and it alone
            pids["scheduler"] = pid
        paths.append(Route(f"narwhal-{cfg}", stack.url, pids, stack.stop,
                           frozenset({"scheduler"}), envoy_admin=stack.envoy_admin_port))
    return paths


def engine_pid(stack: Stack) -> int:
    """The stack's (first) simulator: the engine's CPU is charged to the path it serves."""
    return stack.proc(stack.sims[0].name).popen.pid


def envoy_alone(sim_port: int, workdir: Path, sim_pid: int) -> Route:
    """Envoy proxying straight to the simulator (``bench/envoy-direct.yaml``, whose process
    is ``sim_pid``): the path every other's CPU is a ratio to."""
    envoy, port = plain_envoy(REPO_ROOT / "bench" / "envoy-direct.yaml", workdir, [sim_port])

    def stop() -> None:
        envoy.terminate()
        envoy.wait()

    return Route("envoy", f"http://127.0.0.1:{port}", {"envoy": envoy.pid, "engine": sim_pid},
                 stop)


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def null_path(sim: SimSpec, workdir: Path, compiled: bool = False,
              envoy_change: Callable[[dict], None] | None = None, name: str = "") -> Route:
    """Envoy (the shipped config, over a Unix socket as the others) and a null processor
    answering with no logic, against a simulator of its own: ``bench.null_extproc`` on
    Narwhal's transport (the floor of any Python processor in Narwhal's place) or, with
    ``compiled``, ``bench/null_extproc.c`` (the floor of any processor). ``envoy_change``
    edits the Envoy config first (``bench.envoy_variants``); ``name`` names the path."""
    sims = Stack(sims=[dataclasses.replace(sim, port=0)], workdir=workdir).start_sims()
    sim_port = sims.sims[0].port
    sock = str(Path(tempfile.mkdtemp(prefix="nw-")) / "null.sock")
    name = name or ("null-compiled" if compiled else "null-processor")
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115  (closed by stop)
    procs: list[subprocess.Popen] = []

    def stop() -> None:
        for p in reversed(procs):  # Envoy first
            p.terminate()
            p.wait()
        log.close()
        sims.stop()

    try:
        dest = f"127.0.0.1:{sim_port}"
        cmd = (null_extproc.compiled_command(sock, dest, workdir) if compiled else
               null_extproc.python_command(sock, dest))
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=REPO_ROOT))
        deadline = time.monotonic() + 30
        while not _listening(sock):
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench: the null processor did not start ({workdir})")
            time.sleep(0.05)
        port, admin = free_port(), free_port()
        cfg = render_envoy(port, admin, 0, engines=[f"127.0.0.1:{sim_port}"],
                           extproc_socket=sock)
        if envoy_change is not None:
            envoy_change(cfg)
        path = workdir / f"envoy-{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        procs.append(subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--log-level", "warn", "--base-id", str(port),
             "--disable-hot-restart"], stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
        wait_http(f"http://127.0.0.1:{admin}/ready", 30, procs[1])
    except BaseException:
        stop()
        raise
    return Route(name, f"http://127.0.0.1:{port}",
                 {"envoy": procs[1].pid, "narwhal": procs[0].pid, "engine": engine_pid(sims)},
                 stop, envoy_admin=admin)


def measure(paths: list[Route], body: dict, connections: int, units_per_request: int,
            args: argparse.Namespace, workdir: Path) -> None:
    path = "/v1/chat/completions"
    for p in paths:  # warm every path
        wrk(p.url + path, body, 1, connections, workdir)
    for _ in range(args.reps):
        for p in paths:
            def usage(role: str, pid: int, p: Route = p) -> tuple[float, float]:
                if role in p.alone:
                    return cpu_seconds(pid), io_calls(pid)
                return tree_cpu(pid), _tree(pid, io_calls)

            before = {role: usage(role, pid) for role, pid in p.pids.items()}
            sent = ext_proc_messages(p.envoy_admin) if p.envoy_admin else 0
            n, rps, bad = wrk(p.url + path, body, args.duration, connections, workdir)
            if gone := [role for role, pid in p.pids.items() if not running(pid)]:
                raise SystemExit(f"bench: {p.name}: the {', '.join(gone)} process exited "
                                 f"(logs in {workdir})")
            p.errors += bad
            p.rps.append(rps)
            units = max(1, n * units_per_request)
            if p.envoy_admin:
                p.messages.append((ext_proc_messages(p.envoy_admin) - sent) / units)
            for role, pid in p.pids.items():
                (cpu0, calls0), (cpu1, calls1) = before[role], usage(role, pid)
                p.cpu_us.setdefault(role, []).append((cpu1 - cpu0) / units * 1e6)
                p.syscalls.setdefault(role, []).append((calls1 - calls0) / units)


@dataclass
class Row:
    workload: str
    unit: str  # "request" or "token event"
    path: str
    rate: float
    cpu: dict[str, float]  # role -> median µs per unit
    errors: int
    syscalls: dict[str, float] = field(default_factory=dict)  # role -> median per unit
    messages: float | None = None  # ext_proc messages per unit, both ways (median)


def find(rows: list[Row], workload: str, path: str) -> Row | None:
    """The row of ``path`` under ``workload``, or None when the run left it out."""
    return next((r for r in rows if r.workload == workload and r.path == path), None)


def rows_of(workload: str, unit: str, paths: list[Route], per_unit: int) -> list[Row]:
    return [Row(workload, unit, p.name, statistics.median(p.rps) * per_unit,
                {role: statistics.median(v) for role, v in p.cpu_us.items()}, p.errors,
                {role: statistics.median(v) for role, v in p.syscalls.items()},
                statistics.median(p.messages) if p.messages else None)
            for p in paths]


def run_workload(sim: SimSpec, workloads: list[tuple[str, dict, int, int]],
                 args: argparse.Namespace, workdir: Path) -> list[Row]:
    paths = start_paths(sim, args.configs.split(","), args.transport, workdir, args.peer)
    rows: list[Row] = []
    try:
        for name, body, connections, per_unit in workloads:
            for p in paths:
                p.rps.clear()
                p.cpu_us.clear()
                p.syscalls.clear()
                p.messages.clear()
                p.errors = 0
            measure(paths, body, connections, per_unit, args, workdir)
            rows += rows_of(name, "token event" if per_unit > 1 else "request", paths, per_unit)
    finally:
        for p in paths:
            p.stop()
    return rows


# Roles a row reports apart from the router's whole path: the workers' scheduler (already
# counted in narwhal) and the engine.
APART = frozenset({"scheduler", "engine"})


def report(rows: list[Row]) -> list[str]:
    out = []
    for workload in dict.fromkeys(r.workload for r in rows):
        group = [r for r in rows if r.workload == workload]
        base = next(r for r in group if r.path == "envoy")
        envoy_cpu = base.cpu["envoy"]
        unit = base.unit
        out.append(f"\n{workload}  (CPU us per {unit}; ratio to Envoy alone's CPU; the "
                   "engine's, the simulator's, apart and as a ratio to its own beside Envoy "
                   "alone)")
        out.append(f"  {'path':16} {'rate/s':>9} {'vs envoy':>9}   {'envoy':>14} "
                   f"{'narwhal':>14} {'peer':>14} {'whole path':>14} {'of which sched':>14} "
                   f"{'engine':>14}")
        for r in group:
            total = sum(v for role, v in r.cpu.items() if role not in APART)

            def cell(role: str, r: Row = r, base_cpu: float = envoy_cpu) -> str:
                v = r.cpu.get(role)
                return f"{v:7.1f} {v / base_cpu:5.2f}x" if v is not None else " " * 14

            err = f"   ({r.errors} non-2xx)" if r.errors else ""
            out.append(f"  {r.path:16} {r.rate:9.0f} {r.rate / base.rate:8.1%}   "
                       f"{cell('envoy')} {cell('narwhal')} {cell('vllm-router')} "
                       f"{total:7.1f} {total / envoy_cpu:5.2f}x {cell('scheduler')} "
                       f"{cell('engine', base_cpu=base.cpu.get('engine', 0.0) or 1.0)}{err}")
    return out


def workers_line(rows: list[Row]) -> list[str]:
    """workers: 2 against one process: Narwhal's CPU per unit, and the scheduler's share."""
    out = []
    for workload in dict.fromkeys(r.workload for r in rows):
        one = find(rows, workload, "narwhal-default")
        two = find(rows, workload, "narwhal-workers2")
        if one is None or two is None:
            continue
        a, b, sched = one.cpu["narwhal"], two.cpu["narwhal"], two.cpu["scheduler"]
        out.append(f"workers 2 vs 1, {workload}: {b:.1f} vs {a:.1f} us per {one.unit} "
                   f"({b / a - 1:+.0%}); the scheduler process {sched:.1f} us of it, the "
                   f"workers {b - sched:.1f} us ({(b - sched) / a - 1:+.0%} of one process)")
        if "narwhal" in one.syscalls and "narwhal" in two.syscalls:
            workers = two.syscalls["narwhal"] - two.syscalls["scheduler"]
            out.append(f"  socket reads and writes per {one.unit}: one process "
                       f"{one.syscalls['narwhal']:.2f}, the workers {workers:.2f}, the "
                       f"scheduler {two.syscalls['scheduler']:.2f}")
    return ["", *out] if out else []


def floor_line(rows: list[Row]) -> list[str]:
    """Each null processor against Narwhal's default: what any Python processor on this
    transport, and any compiled one, costs per unit, what Envoy costs beside it, the
    stack's throughput against Envoy alone's, and Narwhal's own work above the floor."""
    out = []
    for workload in dict.fromkeys(r.workload for r in rows):
        mine, envoy = find(rows, workload, "narwhal-default"), find(rows, workload, "envoy")
        for path, what in (("null-processor", "a Python processor with no logic"),
                           ("null-compiled", "a compiled processor with no logic")):
            null = find(rows, workload, path)
            if mine is None or null is None:
                continue
            floor, own = null.cpu["narwhal"], mine.cpu["narwhal"]
            rate = f", {null.rate / envoy.rate:.1%} of Envoy alone's rate" if envoy else ""
            line = (f"floor, {workload}: {what} {floor:.1f} us per {mine.unit} (Envoy beside "
                    f"it {null.cpu['envoy']:.1f}{rate})")
            if path == "null-processor":
                line += f"; Narwhal {own:.1f}: its own work {own - floor:.1f} us " \
                        f"({(own - floor) / own:.0%})"
            out.append(line)
    return ["", *out] if out else []


def stream_line(rows: list[Row]) -> list[str]:
    """What the engine's stream costs the non-streaming rate. Narwhal asks the engine for a
    stream and assembles the answer (so would any router that counts tokens as they come),
    so the engine writes, and Envoy relays, the streaming row's answer where Envoy alone's
    non-streaming path gets one body: Envoy alone streaming is the rate of the same engine
    work with no processor, and each processor's non-streaming rate is put against it."""
    whole, streamed = find(rows, "non-streaming", "envoy"), find(rows, "streaming", "envoy")
    if whole is None or streamed is None:
        return []
    engine = ""
    if "engine" in whole.cpu and "engine" in streamed.cpu:
        engine = (f"; the engine {streamed.cpu['engine']:.1f} us a request streamed against "
                  f"{whole.cpu['engine']:.1f} in one body, Envoy {streamed.cpu['envoy']:.1f} "
                  f"against {whole.cpu['envoy']:.1f}")
    out = [f"the engine's stream, non-streaming: Envoy alone with the engine streaming the "
           f"answer {streamed.rate:.0f}/s, {streamed.rate / whole.rate:.1%} of its rate with "
           f"one body{engine}"]
    paths = [r for r in rows if r.workload == "non-streaming"
             and (r.path.startswith("null-") or r.path.startswith("narwhal-"))]
    if paths:
        out.append("  non-streaming rate against Envoy alone's with the same engine stream: "
                   + ", ".join(f"{r.path} {r.rate / streamed.rate:.1%}" for r in paths))
    # Envoy's CPU above relaying the stream alone, over the messages it exchanged: its
    # per-stream cost is in the figure too (a path with fewer messages reads higher).
    counted = [r for r in paths if r.messages]
    if counted:
        out.append("  ext_proc messages a request (both ways), and Envoy's CPU above Envoy "
                   "alone's with the stream, per message: " + ", ".join(
                       f"{r.path} {r.messages:.1f}, "
                       f"{(r.cpu['envoy'] - streamed.cpu['envoy']) / r.messages:.1f} us"
                       for r in counted))
    return ["", *out]


def criteria(rows: list[Row]) -> list[str]:
    """The data-path targets (the project's issue on this cost), each judged on this run:
    Narwhal's CPU against Envoy alone's and against an absolute bound, the stack's
    throughput against Envoy alone's, and ``workers: 2`` against one process."""
    out = []

    def judge(what: str, ok: bool, measured: str) -> None:
        out.append(f"  {'met    ' if ok else 'not met'}  {what}: {measured}")

    for workload, unit, share, bound in (("non-streaming", "request", 1.0, 120.0),
                                         ("paced streams", "token event", 0.3, 8.0)):
        envoy, one = find(rows, workload, "envoy"), find(rows, workload, "narwhal-default")
        if envoy is None or one is None:
            continue
        mine, theirs = one.cpu["narwhal"], envoy.cpu["envoy"]
        judge(f"Narwhal's CPU per {unit} <= {share:g}x Envoy alone's and <= {bound:g} us",
              mine <= share * theirs and mine <= bound,
              f"{mine:.1f} us, {mine / theirs:.2f}x Envoy's {theirs:.1f}")
        if workload == "non-streaming":
            streamed = find(rows, "streaming", "envoy")
            against = (f" ({one.rate / streamed.rate:.1%} of Envoy alone's with the engine "
                       "streaming the answer, as it does for Narwhal)" if streamed else "")
            judge("Envoy + Narwhal throughput >= 50% of Envoy alone's",
                  one.rate >= 0.5 * envoy.rate, f"{one.rate / envoy.rate:.1%}{against}")
        two = find(rows, workload, "narwhal-workers2")
        if two is not None:
            workers = two.cpu["narwhal"] - two.cpu["scheduler"]
            judge(f"workers: 2, the workers' CPU per {unit} within 10% of one process's "
                  f"(the scheduler's {two.cpu['scheduler']:.1f} us reported apart)",
                  workers <= 1.1 * one.cpu["narwhal"],
                  f"{workers / one.cpu['narwhal'] - 1:+.0%}")
    return ["", "targets (default configuration, this run):", *out] if out else []


def capacity(rows: list[Row], per_engine_us: float) -> list[str]:
    """On paper: how much one core of Narwhal serves, from the measured costs; a request
    costs ``per_engine_us`` more for each engine of the pool (measured in process: this
    benchmark's pool is one simulator)."""
    def cost(workload: str, path: str) -> float | None:
        r = find(rows, workload, path)
        return None if r is None else r.cpu.get("narwhal")

    per_req = cost("non-streaming", "narwhal-default") or cost("non-streaming", "narwhal-wide")
    per_event = cost("paced streams", "narwhal-default") or cost("paced streams", "narwhal-wide")
    if per_req is None or per_event is None:
        return []
    # A GPU serving a mid-size model streams ~2,500 tokens/s and finishes ~10 requests/s
    # (e.g. 250-token answers at batch 32): per-GPU Narwhal load is events + requests, and
    # each request's admission projects every GPU of the pool. N GPUs on one core:
    # N * (2500 e + 10 (r + s (N - 1))) = 1e6 us per second, solved for N.
    a = 10 * max(0.0, per_engine_us)
    b = 2500 * per_event + 10 * per_req - a
    gpus = 1e6 / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * 1e6)) / (2 * a)
    return [f"\ncapacity on paper: {per_req:.0f} us/request (+{per_engine_us:.1f} us for each"
            f" engine of the pool, in process) + {per_event:.1f} us/token event"
            f" -> one core serves ~{gpus:.0f} GPUs at 2,500 token events/s and"
            f" 10 requests/s each"]


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4))
    for ax, workload in zip(axes, workloads, strict=True):
        group = [r for r in rows if r.workload == workload]
        roles = ["envoy", "narwhal", "vllm-router"]
        bottom = [0.0] * len(group)
        for role in roles:
            vals = [r.cpu.get(role, 0.0) for r in group]
            ax.bar([r.path for r in group], vals, bottom=bottom, label=role)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_title(workload)
        ax.set_ylabel(f"CPU us per {group[0].unit}")
        ax.tick_params(axis="x", rotation=30)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--reps", type=int, default=3, help="runs per path (median reported)")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections for (a)")
    parser.add_argument("--configs", default="default,wide,workers2,null,cnull",
                        help="Narwhal configs to measure: default, wide, workers2; null: "
                        "a processor on Narwhal's transport with no logic (the floor); "
                        "cnull: the same compiled (C, nghttp2)")
    parser.add_argument("--transport", default="asyncio", choices=["asyncio", "grpcio"])
    parser.add_argument("--no-peer", dest="peer", action="store_false",
                        help="leave vllm-router out")
    parser.add_argument("--plot", type=Path, help="write a PNG of CPU per unit by path")
    args = parser.parse_args()
    configs = args.configs.split(",")
    if unknown := set(configs) - {"default", "wide", "workers2", *NULLS}:
        parser.error(f"--configs: unknown {', '.join(sorted(unknown))}")
    if not set(configs) - set(NULLS):
        parser.error("--configs: name a Narwhal config besides the null processors")
    if shutil.which("wrk") is None:
        print("bench: wrk not found (apt-get install wrk)", file=sys.stderr)
        return 2
    if args.peer:
        vllm_router_exe()  # before any path runs (--no-peer leaves it out)
    short = {"model": MODEL, "max_tokens": 16,
             "messages": [{"role": "user", "content": "hello there"}]}
    paced = short | {"stream": True, "max_tokens": PACED_TOKENS}
    with scratch("narwhal-bench-") as workdir:
        rows = run_workload(SimSpec("instant"), [
            ("non-streaming", short | {"stream": False}, args.connections, 1),
            ("streaming", short | {"stream": True}, args.connections, 1)], args, workdir)
        rows += run_workload(
            SimSpec("paced", args=["--tpot-ms", "5", "--max-num-seqs", "1024"]),
            [("paced streams", paced, PACED_CLIENTS, PACED_TOKENS)], args, workdir)
    loop = os.environ.get("NARWHAL_LOOP", "uvloop")
    print(f"Narwhal data-path benchmark ({os.cpu_count()} CPUs, loop {loop}, transport "
          f"{args.transport}, medians of {args.reps} x {args.duration:g}s)")
    print(f"reproduce: python -m bench.datapath --duration {args.duration:g} --reps {args.reps}"
          f" --connections {args.connections} --configs {args.configs}"
          f" --transport {args.transport}" + ("" if args.peer else " --no-peer"))
    # What each engine of the pool adds to a request, in process (bench.messages).
    runs = messages.alternated(500, [(1, 0), (32, 0)], 3)
    per_engine = messages.slope({p: runs[p, 0] for p in (1, 32)}) * 1e6
    for line in (report(rows) + workers_line(rows) + floor_line(rows) + stream_line(rows)
                 + criteria(rows) + capacity(rows, per_engine)):
        print(line)
    if args.plot:
        plot(rows, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
