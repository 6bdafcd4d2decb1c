"""The promise against real vLLM: predictive admission in front of a vLLM 0.32 CPU server,
under open-loop load, beside the same server reached directly.

    python -m bench.vllm_admission [--duration S] [--warmup S] [--loads 1,1.5]
        [--budget-ms MS] [--capacity RPS] [--samples DIR]

Why it exists: the scheduling benchmark's engines are ``narwhal sim``, written to vLLM
v1's scheduler semantics but written here. This one puts a real continuous-batching
engine that Narwhal did not write behind Envoy + Narwhal: vLLM's CPU build serving a
random-weight Llama of the "small" shape (``integration/vllm/model.py``; ~0.9 ms a prompt
token and ~14 ms an output token on one thread of this machine, so that its queue is
seconds deep under load, not noise), ``--max-num-seqs 8``, chunked prefill, prefix caching
off. Narwhal runs its defaults (four prefill slots per engine, the model seeds, drift
scoring) but for the TTFT target (``--budget-ms``) and the request limits a queue of this
depth needs; the path ``least-work`` runs it with the scheduling benchmark's goodput
settings instead (``NARWHAL_PATHS``). The engine shares this machine's two cores with
Envoy, Narwhal and the load generator: its speed moves with their load, which is the
point (nothing holds it still).

Workload: single-turn streaming chat, prompts lognormal (median ~125 tokens, at most
~550), ``max_tokens`` lognormal (median 24, at most 96; a random-weight model seldom
stops by itself, so ``max_tokens`` is the output length). ``--capacity``: the engine's
saturated throughput in requests/s; without it the run measures it first (16 clients
in a closed loop straight to vLLM, which runs 8 at a time). Per path and load: goodput
(completed within the budget, per second), % of admitted within it, TTFT p50/p90/p99,
refused, of the refusals the share given up from Narwhal's queue after a wait (``gave
up``: their message says so) and the 90th percentile of the refused clients' wait for
their answer (``wait p90``), and Narwhal's TTFT prediction error (header
``x-narwhal-predicted-ttft-ms`` against the client's measurement). ``direct`` is the
client straight to vLLM: what any router without admission control gives in front of
one engine.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol, TypeVar

import aiohttp
import orjson
from integration.vllm.engine import SERVED_MODEL, VllmServer, built_model

from bench import names, run_arguments, scratch
from bench.scheduling import (
    INTERACTIVE,
    INTERACTIVE_PRIORITY,
    Result,
    StatusTrace,
    _fmt,
    apart,
    class_arguments,
    class_flags,
    dump,
    labelled,
    profiled,
    stream,
    summarize,
)
from narwhal.launch import Stack

# Narwhal's settings by path: its defaults, and the goodput settings the scheduling
# benchmark recommends (the least-work queue order, prefill bounded at 1,536 tokens an
# engine: three quarters of vLLM's 2,048-token step).
NARWHAL_PATHS: dict[str, dict] = {
    "narwhal": {},
    "least-work": {"admission": {"queue_order": "least-work"},
                   "scheduler": {"max_prefill_tokens_per_engine": 1536}},
    # The same with priorities by objective (``--interactive``) and turns between
    # clients (``--heavy``), to run beside least-work with the same requests.
    "prioritized": {"admission": {"queue_order": "least-work",
                                  "objectives": {INTERACTIVE: INTERACTIVE_PRIORITY}},
                    "scheduler": {"max_prefill_tokens_per_engine": 1536}},
    "fair": {"admission": {"queue_order": "least-work", "fairness": "round-robin"},
             "scheduler": {"max_prefill_tokens_per_engine": 1536}},
}
PATHS = (*NARWHAL_PATHS, "direct")
WORDS = ("the quick brown fox jumps over lazy dog narwhal tusk ocean arctic ice whale pod "
         "swim deep cold water light wave router engine token prefill decode budget").split()
CLIENT_TIMEOUT_S = 120.0


def prose(rng: random.Random, words: int) -> str:
    """``words`` words: about as many of this tokenizer's tokens (each word of ``WORDS``,
    with its leading space, is one)."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def output_tokens(rng: random.Random) -> int:
    """A request's ``max_tokens``, its output length (a random-weight model seldom stops
    by itself): lognormal, median 24, 4-96."""
    return min(96, max(4, round(rng.lognormvariate(math.log(24), 0.6))))


def chat_body(messages: list[dict], max_tokens: int) -> dict:
    """A streaming chat request to the served model, asking for its usage."""
    return {"model": SERVED_MODEL, "stream": True, "max_tokens": max_tokens,
            "messages": messages, "stream_options": {"include_usage": True}}


def request_body(rng: random.Random) -> dict:
    """One single-turn chat request: a prompt of 10-550 words (lognormal, median 125;
    about as many tokens), ``max_tokens`` as the output length."""
    words = min(550, max(10, round(rng.lognormvariate(math.log(125), 0.7))))
    out = output_tokens(rng)
    return chat_body([{"role": "user", "content": prose(rng, words)}], out)


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> Result:
    return (await stream(session, url, body))[0]


def classed(interactive: float, heavy: float
            ) -> Callable[[aiohttp.ClientSession, str, dict], Awaitable[Result]]:
    """``one``, naming the objective and fairness ID ``bench.scheduling`` draws
    (``--interactive``, ``--heavy``), from the request's prompt: the same requests in
    every path, since the bodies are drawn from the seed."""
    async def send(session: aiohttp.ClientSession, url: str, body: dict) -> Result:
        key = zlib.crc32(orjson.dumps(body["messages"]))
        return (await labelled(session, url, body, key, interactive, heavy))[0]
    return send


class Sent(Protocol):
    start: float  # when its (first) request went


S = TypeVar("S", bound=Sent)


async def drive(url: str, rate: float, warmup: float, duration: float, seed: int,
                send: Callable[[aiohttp.ClientSession, str, dict], Awaitable[S]] = one,
                ) -> list[S]:
    """Poisson arrivals at ``rate`` for ``warmup`` + ``duration`` s, each a body sent by
    ``send`` (one request by default; ``bench.vllm_retries``: a request and its
    retries); returns what those that arrived after the warm-up came to."""
    rng, bodies = random.Random(seed), random.Random(seed + 1)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t = time.monotonic()
        measured, end = t + warmup, t + warmup + duration
        tasks = []
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.ensure_future(send(session, url, request_body(bodies))))
        done = await asyncio.gather(*tasks)
    return [r for r in done if r.start >= measured]


async def saturate(url: str, clients: int, warmup: float, duration: float) -> float:
    """Completions per second with ``clients`` requests always outstanding."""
    bodies = random.Random(99)
    ends: list[float] = []
    stop = time.monotonic() + warmup + duration

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop:
            r = await one(session, url, request_body(bodies))
            if r.status == 200 and r.end is not None:
                ends.append(r.end)

    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(clients)))
    counted = [e for e in ends if start + warmup <= e <= stop]
    return len(counted) / duration


def narwhal_config(engines: list[dict], budget_ms: int, path: str = "narwhal",
                   scheduler: dict | None = None, **sections: dict) -> dict:
    """Narwhal's configuration for ``path`` in front of ``engines`` (its ``engines``
    entries); ``scheduler`` settings add to the path's, ``sections`` to the config."""
    extra = NARWHAL_PATHS[path]
    config = {
        "serving": {"model": SERVED_MODEL},
        "admission": {"mode": "predictive", "ttft_target_ms": budget_ms, "queue_limit": 1024,
                      "retention_limit": 4096, "max_wait_ms": 600_000,
                      **extra.get("admission", {})},
        "engines": engines,
        **sections,
    }
    if merged := {**extra.get("scheduler", {}), **(scheduler or {})}:
        config["scheduler"] = merged
    return config


def narwhal(engine: VllmServer, budget_ms: int, path: str = "narwhal") -> Stack:
    config = narwhal_config([engine.engine_config()], budget_ms, path)
    stack = Stack(sims=[], config=config, model=SERVED_MODEL).start()
    profiled(stack)
    return stack


def start_engine(workdir: Path) -> VllmServer:
    return VllmServer("vllm-small", built_model(workdir / "model", "small"), workdir).spawn().wait()


def cell_arguments(parser: argparse.ArgumentParser) -> None:
    """The single-engine benchmarks' cells: how long, at which loads of the engine's
    capacity (measured unless given), against which TTFT budget; and ``run_arguments``."""
    parser.add_argument("--duration", type=float, default=120.0, help="measured seconds a cell")
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="seconds of load at the cell's rate before it is measured")
    parser.add_argument("--loads", default="1,1.5", help="multiples of the engine's capacity")
    parser.add_argument("--budget-ms", type=int, default=3000, help="TTFT budget")
    parser.add_argument("--capacity", type=float, default=0.0,
                        help="the engine's saturated requests/s (measured first if absent)")
    run_arguments(parser)


def capacity_of(engine: VllmServer, given: float) -> float:
    """``given``, or the engine's saturated throughput: 16 clients in a closed loop
    straight to it (it runs 8 at a time)."""
    return given or asyncio.run(saturate(f"{engine.url}/v1/chat/completions", 16, 15.0, 45.0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default=",".join(PATHS))
    class_arguments(parser, "on the path prioritized", "on the path fair")
    cell_arguments(parser)
    args = parser.parse_args()
    send = classed(args.interactive, args.heavy) if args.interactive or args.heavy else one
    loads = [float(x) for x in args.loads.split(",")]
    paths = names(parser, args.paths, PATHS, "path")
    budget_s = args.budget_ms / 1000
    rows = []
    with scratch("narwhal-vllm-") as workdir:
        engine = start_engine(workdir)
        try:
            direct_url = f"{engine.url}/v1/chat/completions"
            capacity = capacity_of(engine, args.capacity)
            for path in paths:
                stack = (narwhal(engine, args.budget_ms, path) if path in NARWHAL_PATHS
                         else None)
                try:
                    url = (f"{stack.url}/v1/chat/completions" if stack is not None
                           else direct_url)
                    for load in loads:
                        name = f"{path}-{load:g}"
                        trace = (StatusTrace(stack, Path(args.samples) / f"{name}.status.jsonl")
                                 if stack is not None and args.samples else None)
                        results = asyncio.run(drive(url, load * capacity, args.warmup,
                                                    args.duration, args.seed, send))
                        if trace is not None:
                            trace.stop()
                        if args.samples:
                            dump(results, Path(args.samples) / f"{name}.jsonl")
                        rows.append((path, load, summarize(results, args.duration, budget_s,
                                                           1.0)))
                        for tag, part in apart(results, args.interactive, args.heavy):
                            rows.append((f"{path}:{tag}", load,
                                         summarize(part, args.duration, budget_s, 1.0)))
                        print(f"  {name} done", file=sys.stderr)
                finally:
                    if stack is not None:
                        stack.stop()
        finally:
            engine.stop()
    print(f"Narwhal against real vLLM (CPU, model 'small', max-num-seqs 8): TTFT budget "
          f"{args.budget_ms} ms; engine capacity {capacity:.2f} req/s"
          f"{' (given)' if args.capacity else ' (measured)'}")
    print(f"reproduce: python -m bench.vllm_admission --duration {args.duration:g} --warmup "
          f"{args.warmup:g} --loads {args.loads} --budget-ms {args.budget_ms} --capacity "
          f"{capacity:.2f} --paths {args.paths} --seed {args.seed}"
          f"{class_flags(args)}")
    print(f"{'path':16} {'load':>4} {'req/s':>6} {'goodput':>7} {'in-budget':>9} {'TTFT p50':>8} "
          f"{'p90':>7} {'p99':>7} {'refused':>7} {'gave up':>7} {'wait p90':>8} {'other':>5} "
          f"{'pred p50/p90/MAPE':>19}")
    for path, load, s in rows:
        err = (f"{_fmt(s['err50'], True)}/{_fmt(s['err90'], True)}/{_fmt(s['mape'], True)}"
               if s["err50"] is not None else "-")
        print(f"{path:16} {load:>4g} {s['offered'] / args.duration:6.2f} {s['goodput']:7.2f} "
              f"{s['in_budget']:9.1%} {_fmt(s['ttft50']):>8} {_fmt(s['ttft90']):>7} "
              f"{_fmt(s['ttft99']):>7} {s['refused']:7.1%} {_fmt(s['gave_up'], True):>7} "
              f"{_fmt(s['refusal_wait90']):>8} {s['other']:5d} {err:>19}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
