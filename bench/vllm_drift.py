"""Drift on real vLLM: the engine slows down mid-run, and Narwhal must notice.

    python -m bench.vllm_drift [--load 0.8] [--hog-at 40] [--hog-for S] [--duration 110]
        [--budget-ms MS]

Why it exists: the scheduling benchmark's drift target (an engine that changed is found
within 10 s, with at most 2% of its requests late meanwhile) is measured on ``narwhal
sim``, whose slowdown is a parameter. Here the engine is vLLM's CPU build over the
"small" model (as ``bench.vllm_admission``), its processes pinned to CPU 1 with
``taskset``; ``--hog-at`` seconds into an open-loop run at ``--load`` times its capacity
(measured pinned, first), a busy loop joins CPU 1, and the engine runs at about half
speed from then on (for ``--hog-for`` seconds, when given: then it is as fast as before
again, the other way an engine changes): a change Narwhal was not told of, made by the
operating system. Printed: when the engine's model was reset for drift (``/status``
``drift_resets``, sampled twice a second) after the slowdown (and after the speed-up),
and per window of arrivals (before, the first 10 s, 10-30 s, after) the requests sent,
admitted, late against the budget and refused, and the TTFT prediction error's p90.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from bench import run_arguments, scratch
from bench.scheduling import Result, StatusTrace, dump, quantile
from bench.vllm_admission import drive, narwhal, saturate, start_engine

WINDOWS = ((None, 0.0), (0.0, 10.0), (10.0, 30.0), (30.0, None))  # arrivals, s after the hog


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (vLLM's API server starts its engine core)."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [pid, *(p for c in children.stdout.split() for p in process_tree(int(c)))]


def pin(pids: list[int], cpu: int) -> None:
    """Every thread of each process onto ``cpu``."""
    for pid in pids:
        subprocess.run(["taskset", "-a", "-pc", str(cpu), str(pid)], check=True,
                       capture_output=True)


async def slowed(url: str, rate: float, hog_at: float, hog_for: float | None,
                 duration: float, seed: int, cpu: int
                 ) -> tuple[list[Result], float, float | None]:
    """Open-loop load for ``duration`` s; ``hog_at`` s in, a busy loop on ``cpu`` for
    ``hog_for`` s (None: until the end). The results, and when the loop started and
    stopped (``time.monotonic``; None: it ran to the end)."""
    load = asyncio.ensure_future(drive(url, rate, 0.0, duration, seed))
    await asyncio.sleep(hog_at)
    hog = subprocess.Popen(["taskset", "-c", str(cpu), "sh", "-c", "while :; do :; done"])
    started, stopped = time.monotonic(), None
    try:
        if hog_for is not None:
            await asyncio.sleep(hog_for)
            hog.kill()
            stopped = time.monotonic()
        return await load, started, stopped
    finally:
        hog.kill()
        hog.wait()


def first_reset(trace: list[dict[str, Any]], at: float) -> float | None:
    """Seconds from ``at`` to the first ``/status`` sample whose engine shows a drift reset
    more than the last sample before ``at`` did; None if none does."""
    before = [r["engines"][0]["drift_resets"] for r in trace if r["t"] < at]
    base = before[-1] if before else 0
    return next((r["t"] - at for r in trace
                 if r["t"] >= at and r["engines"][0]["drift_resets"] > base), None)


def windows(results: list[Result], at: float, budget_s: float, start: float | None = None,
            end: float | None = None) -> list[dict[str, Any]]:
    """Per window of arrivals relative to ``at`` (of those from ``start`` to ``end``, when
    given): sent, admitted, late (admitted, first token after the budget or never),
    refused (429), the prediction error's p90."""
    results = [r for r in results if (start is None or r.start >= start)
               and (end is None or r.start < end)]
    rows = []
    for lo, hi in WINDOWS:
        sel = [r for r in results if (lo is None or r.start - at >= lo)
               and (hi is None or r.start - at < hi)]
        ok = [r for r in sel if r.status == 200]
        errs = [abs(r.predicted_s - r.ttft_s) / r.ttft_s for r in ok
                if r.ttft_s and r.predicted_s is not None]
        rows.append({"window": (lo, hi), "sent": len(sel), "admitted": len(ok),
                     "late": sum(_late(r, budget_s) for r in ok),
                     "refused": sum(1 for r in sel if r.status == 429),
                     "err90": quantile(errs, 0.9) if errs else None})
    return rows


def meanwhile(results: list[Result], at: float, found: float | None,
              budget_s: float) -> tuple[int, int]:
    """(late, admitted) of the requests that arrived from one budget before the change at
    ``at`` until it was found ``found`` s later (to the end if never): the drift target's
    "late meanwhile", over the window the scheduling benchmark counts (a request that
    arrived a budget before the change may still be waiting through it); unlike there, an
    admitted request that never had a first token counts here, as late."""
    ok = [r for r in results if r.status == 200 and r.start >= at - budget_s
          and (found is None or r.start <= at + found)]
    return sum(_late(r, budget_s) for r in ok), len(ok)


def _late(r: Result, budget_s: float) -> bool:
    """An admitted request whose first token came after the budget, or never."""
    return r.ttft_s is None or r.ttft_s > budget_s


def _window_name(lo: float | None, hi: float | None) -> str:
    if lo is None:
        return "before"
    return f"+{lo:g}..+{hi:g} s" if hi is not None else f"after +{lo:g} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=float, default=0.8,
                        help="multiple of the engine's capacity (before the slowdown)")
    parser.add_argument("--hog-at", type=float, default=40.0,
                        help="seconds into the run when the engine slows down")
    parser.add_argument("--hog-for", type=float, default=None,
                        help="seconds the engine stays slow (default: to the end)")
    parser.add_argument("--duration", type=float, default=110.0, help="seconds of load")
    parser.add_argument("--budget-ms", type=int, default=3000, help="TTFT budget")
    run_arguments(parser)
    args = parser.parse_args()
    if not 0 < args.hog_at < args.duration:
        parser.error("--hog-at must fall within --duration")
    if args.hog_for is not None and not 0 < args.hog_at + args.hog_for < args.duration:
        parser.error("--hog-at + --hog-for must fall within --duration")
    cpu = 1
    with scratch("narwhal-vllm-drift-") as workdir:
        engine = start_engine(workdir)
        try:
            assert engine.proc is not None
            pin(process_tree(engine.proc.popen.pid), cpu)
            capacity = asyncio.run(saturate(f"{engine.url}/v1/chat/completions", 16, 10.0, 30.0))
            stack = narwhal(engine, args.budget_ms)
            try:
                path = Path(args.samples or workdir) / "drift.status.jsonl"
                trace = StatusTrace(stack, path)
                results, at, back = asyncio.run(slowed(
                    f"{stack.url}/v1/chat/completions", args.load * capacity, args.hog_at,
                    args.hog_for, args.duration, args.seed, cpu))
                trace.stop()
                samples = [orjson.loads(line) for line in path.read_bytes().splitlines()]
                if args.samples:
                    dump(results, Path(args.samples) / "drift.jsonl")
            finally:
                stack.stop()
        finally:
            engine.stop()
    found = first_reset([r for r in samples if back is None or r["t"] < back], at)
    print(f"Drift on real vLLM (CPU, model 'small', pinned to CPU {cpu}; capacity "
          f"{capacity:.2f} req/s pinned): load {args.load:g}x, a busy loop on its CPU "
          f"{args.hog_at:g} s in; TTFT budget {args.budget_ms} ms")
    print(f"reproduce: python -m bench.vllm_drift --load {args.load:g} --hog-at "
          f"{args.hog_at:g}{'' if back is None else f' --hog-for {args.hog_for:g}'} "
          f"--duration {args.duration:g} --budget-ms {args.budget_ms} --seed {args.seed}")
    budget_s = args.budget_ms / 1000
    late, admitted = meanwhile(results, at, found, budget_s)
    print("drift found: " + (f"+{found:.1f} s after the slowdown" if found is not None
                             else "never (while slow)")
          + f"; meanwhile {late} of {admitted} admitted late")
    if back is not None:
        again = first_reset(samples, back)
        late, admitted = meanwhile(results, back, again, budget_s)
        print("speed-up found: " + (f"+{again:.1f} s after the engine was fast again"
                                    if again is not None else "never")
              + f"; meanwhile {late} of {admitted} admitted late")
    print(f"{'arrivals':>14} {'sent':>5} {'admitted':>8} {'late':>5} {'refused':>7} "
          f"{'pred p90':>8}")
    blocks = [("the slowdown (before: at full speed)", at, None, back)]
    if back is not None:
        blocks.append(("the speed-up (before: while slow)", back, at, None))
    for label, since, start, end in blocks:
        print(f"arrivals around {label}:")
        for w in windows(results, since, budget_s, start, end):
            err = f"{w['err90']:.0%}" if w["err90"] is not None else "-"
            print(f"{_window_name(*w['window']):>14} {w['sent']:5d} {w['admitted']:8d} "
                  f"{w['late']:5d} {w['refused']:7d} {err:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
