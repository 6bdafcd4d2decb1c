"""Data-path benchmark: Envoy alone vs Envoy -> Narwhal, side by side in one run.

    python -m bench.datapath [--duration S] [--reps N] [--connections C]
                             [--transports asyncio,grpcio] [--slots wide|default]

(a) short requests (16 tokens) against an instant engine, non-streaming and
    streaming: requests/s of both paths, their ratio, Narwhal CPU µs per request;
(b) paced streams (5 ms per token, 64 tokens, 64 concurrent clients): Narwhal CPU
    µs per streamed token event.

CPU is the Narwhal process's own utime+stime from /proc, so load-generator and Envoy
CPU are not charged to it. Load comes from wrk (Debian package `wrk`). Runs
alternate between the two paths and the medians are reported, because a 2-core
machine is noisy.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

from narwhal.launch import REPO_ROOT, SimSpec, Stack, plain_envoy

CLK_TCK = os.sysconf("SC_CLK_TCK")
# Phase slots wide enough that every client's request is in flight at once, as it is
# through Envoy alone: this benchmark measures the data path, not admission queueing.
SLOTS = {"max_prefill_per_engine": 128, "max_decode_per_engine": 256}
MODEL = "narwhal-sim"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def wrk(url: str, body: dict, seconds: float, connections: int, workdir: Path) -> tuple[int, float]:
    script = workdir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {orjson.dumps(orjson.dumps(body).decode()).decode()}\n"
        'wrk.headers["Content-Type"] = "application/json"\n')
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency",
                          "-s", str(script), url], capture_output=True, text=True, check=True)
    text = out.stdout
    if "Non-2xx" in text:
        raise SystemExit(f"wrk saw errors against {url}:\n{text}")
    count = int(re.search(r"(\d+) requests in", text).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
    return count, rps


def short_requests(args: argparse.Namespace, workdir: Path, transport: str) -> list[str]:
    stack = Stack(sims=[SimSpec("instant")], model=MODEL,
                  config={"serving": {"transport": transport},
                          "scheduler": SLOTS if args.slots == "wide" else {}}).start()
    envoy, direct_port = plain_envoy(REPO_ROOT / "bench" / "envoy-direct.yaml", workdir,
                                     [stack.sims[0].port])
    narwhal_pid = stack.proc("narwhal").popen.pid
    rows = []
    try:
        for stream in (False, True):
            body = {"model": MODEL, "max_tokens": 16, "stream": stream,
                    "messages": [{"role": "user", "content": "hello there"}]}
            path = "/v1/chat/completions"
            wrk(f"{stack.url}{path}", body, 1, args.connections, workdir)  # warm both paths
            wrk(f"http://127.0.0.1:{direct_port}{path}", body, 1, args.connections, workdir)
            alone, via, cpu_us = [], [], []
            for _ in range(args.reps):
                alone.append(wrk(f"http://127.0.0.1:{direct_port}{path}", body, args.duration,
                                 args.connections, workdir)[1])
                c0 = cpu_seconds(narwhal_pid)
                n, rps = wrk(f"{stack.url}{path}", body, args.duration, args.connections, workdir)
                cpu_us.append((cpu_seconds(narwhal_pid) - c0) / n * 1e6)
                via.append(rps)
            a, v, c = (statistics.median(x) for x in (alone, via, cpu_us))
            rows.append(f"{transport:8} (a) {'streaming' if stream else 'non-streaming':13}  "
                        f"envoy alone "
                        f"{a:8.0f} req/s   via narwhal {v:8.0f} req/s   ratio {v / a:6.1%}   "
                        f"narwhal CPU {c:6.0f} us/request")
    finally:
        envoy.terminate()
        envoy.wait()
        stack.stop()
    return rows


def paced_streams(args: argparse.Namespace, workdir: Path, transport: str) -> list[str]:
    tokens = 64
    stack = Stack(sims=[SimSpec("paced", args=["--tpot-ms", "5", "--max-num-seqs", "1024"])],
                  model=MODEL,
                  config={"serving": {"transport": transport},
                          "scheduler": SLOTS if args.slots == "wide" else {}}).start()
    narwhal_pid = stack.proc("narwhal").popen.pid
    body = {"model": MODEL, "max_tokens": tokens, "stream": True,
            "messages": [{"role": "user", "content": "hello there"}]}
    try:
        url = f"{stack.url}/v1/chat/completions"
        wrk(url, body, 1, 64, workdir)
        per_event, rates = [], []
        for _ in range(args.reps):
            c0 = cpu_seconds(narwhal_pid)
            n, rps = wrk(url, body, args.duration, 64, workdir)
            per_event.append((cpu_seconds(narwhal_pid) - c0) / (n * tokens) * 1e6)
            rates.append(rps * tokens)
    finally:
        stack.stop()
    return [f"{transport:8} (b) paced streams  5 ms/token x {tokens} tokens x 64 clients: "
            f"{statistics.median(rates):7.0f} token events/s   narwhal CPU "
            f"{statistics.median(per_event):5.1f} us/token event"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--reps", type=int, default=3, help="runs per path (median reported)")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections for (a)")
    parser.add_argument("--transports", default="asyncio,grpcio",
                        help="serving.transport values to measure, comma-separated")
    parser.add_argument("--slots", choices=["wide", "default"], default="wide",
                        help="phase slots: wide enough for every client at once, or the "
                             "default configuration's (requests then queue in Narwhal)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("bench: wrk not found (apt-get install wrk)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="narwhal-bench-"))
    rows = []
    for transport in args.transports.split(","):
        rows += short_requests(args, workdir, transport) + paced_streams(args, workdir, transport)
    loop = os.environ.get("NARWHAL_LOOP", "uvloop")
    print(f"Narwhal data-path benchmark ({os.cpu_count()} CPUs, loop {loop}, medians of "
          f"{args.reps} x {args.duration:g}s)")
    print(f"reproduce: python -m bench.datapath --duration {args.duration:g} --reps {args.reps} "
          f"--connections {args.connections} --transports {args.transports} --slots {args.slots}")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
