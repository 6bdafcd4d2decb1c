"""Scheduling benchmark: a pool of simulated engines of different speeds under open-loop
Poisson load, Narwhal predictive vs Narwhal open vs plain Envoy round robin.

    python -m bench.scheduling [--duration S] [--loads 0.5,1,1.5,2] [--budget-ms MS]

Per policy and load it prints goodput (completions per second whose TTFT was within
the budget), TTFT p50/p99 of admitted requests, the refusal rate, and how far
Narwhal's predicted TTFT (response header x-narwhal-predicted-ttft-ms) was from the
TTFT the client measured (p50/p90 of |predicted - measured| / measured).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from narwhal.launch import REPO_ROOT, SimSpec, Stack, plain_envoy

MODEL = "narwhal-sim"
SPEEDS = (4000.0, 2000.0, 1000.0)  # prefill tokens/s of the three engines
TPOT_MS = 10.0
OUTPUT_TOKENS = 16
PROMPT_MIN, PROMPT_MAX = 200, 1400  # tokens, uniform: mean 800


@dataclass
class Result:
    status: int
    ttft_s: float | None
    predicted_s: float | None


def capacity_rps() -> float:
    """Prefill-bound pool capacity in requests/s for the workload's mean prompt."""
    return sum(SPEEDS) / ((PROMPT_MIN + PROMPT_MAX) / 2)


async def one(session: aiohttp.ClientSession, url: str, tokens: int, seed: int) -> Result:
    body = {"model": MODEL, "stream": True, "max_tokens": OUTPUT_TOKENS, "seed": seed,
            "messages": [{"role": "user", "content": "abcd" * tokens}]}
    start = time.monotonic()
    try:
        async with session.post(url, data=orjson.dumps(body),
                                headers={"content-type": "application/json"}) as resp:
            predicted = resp.headers.get("x-narwhal-predicted-ttft-ms")
            predicted_s = int(predicted) / 1000 if predicted else None
            if resp.status != 200:
                await resp.read()
                return Result(resp.status, None, predicted_s)
            ttft = None
            async for line in resp.content:
                if ttft is None and line.startswith(b"data: {") and b'"content":" ' in line:
                    ttft = time.monotonic() - start
            return Result(200, ttft, predicted_s)
    except (TimeoutError, aiohttp.ClientError):
        return Result(0, None, None)


async def drive(url: str, rate: float, duration: float, seed: int) -> list[Result]:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        t = time.monotonic()
        end = t + duration
        i = 0
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.ensure_future(
                one(session, url, rng.randint(PROMPT_MIN, PROMPT_MAX), seed * 100000 + i)))
            i += 1
        return list(await asyncio.gather(*tasks))


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(results: list[Result], duration: float, budget_s: float) -> dict:
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    good = [r for r in ok if r.ttft_s <= budget_s]
    errs = [abs(r.predicted_s - r.ttft_s) / r.ttft_s for r in ok if r.predicted_s is not None]
    return {
        "offered": len(results),
        "goodput": len(good) / duration,
        "in_budget": len(good) / len(ok) if ok else float("nan"),
        "p50": quantile([r.ttft_s for r in ok], 0.5),
        "p99": quantile([r.ttft_s for r in ok], 0.99),
        "refused": sum(1 for r in results if r.status in (429, 503)) / max(1, len(results)),
        "other": sum(1 for r in results if r.status not in (200, 429, 503)),
        "err50": quantile(errs, 0.5) if errs else None,
        "err90": quantile(errs, 0.9) if errs else None,
    }


def narwhal_stack(sims: list[SimSpec], mode: str, budget_ms: int) -> Stack:
    engines = [{"name": s.name, "url": f"http://127.0.0.1:{s.port}", "dialect": "vllm",
                "prefill_tps": speed} for s, speed in zip(sims, SPEEDS, strict=True)]
    config = {"admission": {"mode": mode, "ttft_target_ms": budget_ms, "queue_limit": 1024,
                            "retention_limit": 4096, "max_wait_ms": 60000},
              "scheduler": {"max_prefill_per_engine": 64, "max_decode_per_engine": 64},
              "engines": engines}
    stack = Stack(sims=[], config=config, model=MODEL)
    return stack.start()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per cell")
    parser.add_argument("--loads", default="0.5,1,1.5,2", help="multiples of pool capacity")
    parser.add_argument("--budget-ms", type=int, default=1000, help="TTFT budget")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    budget_s = args.budget_ms / 1000
    workdir = Path(tempfile.mkdtemp(prefix="narwhal-sched-"))
    sims = [SimSpec(f"e{i}", args=["--prefill-tps", str(speed), "--tpot-ms", str(TPOT_MS),
                                   "--max-num-seqs", "1024"])
            for i, speed in enumerate(SPEEDS)]
    pool = Stack(sims=sims, model=MODEL).start_sims()
    rows = []
    try:
        for policy in ("predictive", "open", "round-robin"):
            if policy == "round-robin":
                envoy, port = plain_envoy(REPO_ROOT / "bench" / "envoy-roundrobin.yaml",
                                          workdir, [s.port for s in sims])
                url, stop = f"http://127.0.0.1:{port}/v1/chat/completions", envoy.terminate
            else:
                stack = narwhal_stack(sims, policy, args.budget_ms)
                url, stop = f"{stack.url}/v1/chat/completions", stack.stop
            try:
                for load in loads:
                    rate = load * capacity_rps()
                    results = asyncio.run(drive(url, rate, args.duration, args.seed))
                    rows.append((policy, load, rate, summarize(results, args.duration, budget_s)))
                    time.sleep(3)  # let the pool drain between cells (not a measurement)
            finally:
                stop()
    finally:
        pool.stop()
    print(f"Narwhal scheduling benchmark: engines prefill {'/'.join(f'{s:g}' for s in SPEEDS)} "
          f"tok/s, TPOT {TPOT_MS:g} ms, prompts {PROMPT_MIN}-{PROMPT_MAX} tokens, "
          f"{OUTPUT_TOKENS} output tokens, TTFT budget {args.budget_ms} ms, "
          f"capacity {capacity_rps():.2f} req/s")
    print(f"reproduce: python -m bench.scheduling --duration {args.duration:g} "
          f"--loads {args.loads} --budget-ms {args.budget_ms} --seed {args.seed}")
    print(f"{'policy':12} {'load':>5} {'req/s':>6} {'goodput':>8} {'in-budget':>9} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'refused':>8} {'pred err p50/p90':>17}")
    for policy, load, rate, s in rows:
        err = (f"{s['err50']:.1%}/{s['err90']:.1%}" if s["err50"] is not None else "-")
        print(f"{policy:12} {load:5.1f} {rate:6.2f} {s['goodput']:8.2f} {s['in_budget']:9.1%} "
              f"{s['p50'] * 1000:7.0f}ms {s['p99'] * 1000:7.0f}ms {s['refused']:8.1%} {err:>17}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
