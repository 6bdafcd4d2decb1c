"""Scheduling benchmark on simulator v2: a heterogeneous pool of continuous-batching
engines under open-loop Poisson load, Narwhal against the routers users pick today.

    python -m bench.scheduling [--duration S] [--loads 0.5,1,1.5,2] [--budget-ms MS]
        [--time-scale F] [--policies ...] [--drift] [--plot FILE.png] [--samples DIR]

Engines: `narwhal sim --profile h100-llama3-8b | a100-llama3-8b | l4-llama3-8b`, all run
``--time-scale`` times slower than the profile so that a 2-core machine can drive them;
times are reported divided by it (real-GPU-equivalent) and the TTFT budget is scaled up
by it. Workload (``--workload chat``): streaming chat; four shared system prompts
(300-1500 tokens) on 80% of conversations; user turns lognormal (median 120 tokens); 35%
of requests continue an earlier conversation with its history; outputs stop by themselves
(lognormal, median 48, scaled by the conversation's application) under ``max_tokens``
1024. ``--workload tenants``: the same conversations, each opening with one of
``--tenants`` (48) applications' system prompts (median 2,500 tokens), so that the prefix
caches are under pressure. ``--warmup S`` runs each cell's load S seconds before
measuring it (the steady state, caches warm, rather than the ramp from an idle pool).

Policies: Narwhal predictive (model seeds at their defaults), Narwhal open, each also with
the prefix index off (``-noprefix``: the open pair compares placement alone, nothing
refused), predictive with the prefix-affinity scorer, predictive on two worker processes
(``predictive-workers2``: the same decisions, served by ``serving.workers: 2``), predictive
configured with a TTFT target of 0.4 of the budget (``predictive-t40``,
``predictive-noprefix-t40``: a shorter queue, its goodput judged against the budget),
predictive with the queue served least expected work first (``predictive-least-work``,
``predictive-noprefix-least-work``: ``admission.queue_order: least-work`` with at most
1,536 uncached prompt tokens in prefill an engine; ``-t40``: with a TTFT target of 0.4 of
the budget, the configuration that keeps p90 TTFT low on the 48-tenant workload), FIFO
with the same bound
(``predictive-tokens``) and with 8 prefill slots an engine (``predictive-p8``), Envoy
round robin,
and `vllm-router` (PyPI) `power_of_two` and `cache_aware`. Per policy and load: goodput
(completed requests per second within the TTFT budget) over the cell and over its second
half (the steady state of a sustained overload: use a long ``--duration``, as
routers without admission serve nothing in budget once their queues are a budget deep),
% of admitted within budget, TTFT and TPOT p50/p99, refusal rate, of the refusals the share
given up from Narwhal's queue after a wait ("gave up") and the refused clients' wait for
their answer (p90, GPU-equivalent), Narwhal's TTFT prediction error p50/p90 and
MAPE (header x-narwhal-predicted-ttft-ms against the client's measurement), its output
length error (x-narwhal-predicted-output-tokens), and how full the engines ran ("full":
the share of the cell's arrivals each engine spent in steps that used up their token
budget, sequence cap or KV blocks with work left over, mean of the engines; each engine's
on its own line with its share in any step: 100% full is an engine computing at its
limit, in budget or not). ``--drift`` adds a run in which the
fastest engine halves its speed a third of the way in: time until Narwhal's /status shows
it detected, and how many of that engine's admitted requests missed the budget meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import orjson
import yaml

from bench import names, scratch, vllm_router, vllm_router_exe
from narwhal.launch import REPO_ROOT, SimSpec, Stack, plain_envoy
from narwhal.server.telemetry import parse_vllm_metrics

MODEL = "narwhal-sim"
ENGINES = (("h100", "h100-llama3-8b"), ("a100", "a100-llama3-8b"), ("l4", "l4-llama3-8b"))
NATURAL_OUTPUT = 48
MAX_TOKENS = 1024
WORDS = ("narwhal tusk ocean arctic ice whale pod swim deep cold water light wave router "
         "engine token prefill decode budget queue admit place stream chunk").split()
POLICIES = ("predictive", "open", "predictive-noprefix", "open-noprefix", "predictive-affinity",
            "predictive-t40", "predictive-noprefix-t40", "predictive-least-work",
            "predictive-noprefix-least-work", "predictive-least-work-t40",
            "predictive-noprefix-least-work-t40", "predictive-tokens", "predictive-p8",
            "predictive-workers2", "round-robin", "vllm-router-p2", "vllm-router-cache")


def text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens for the simulator (4 bytes a token)."""
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


@dataclass(frozen=True)
class Mix:
    """A workload's shared prompts: the system prompts new conversations open with, and
    how often they do."""

    systems: tuple[str, ...]
    system_share: float


def _tenants(n: int = 48) -> tuple[str, ...]:
    """``n`` applications' system prompts (lognormal, median 2,500 tokens, 800-6,000):
    together ~110 k tokens, more than twice what the l4 caches and a quarter of an h100's cache, so
    where a conversation is placed decides whether its prefix is cached."""
    rng = random.Random(7)
    sizes = [min(6000, max(800, round(rng.lognormvariate(math.log(2500), 0.5))))
             for _ in range(n)]
    return tuple(text(random.Random(200 + i), size) for i, size in enumerate(sizes))


WORKLOADS = ("chat", "tenants")


def workload_mix(workload: str, tenants: int) -> Mix:
    """"chat": four shared system prompts on 80% of conversations (every engine caches
    all four, so placement decides little beyond follow-ups); "tenants": ``tenants``
    applications, each with a long system prompt on every conversation (the multi-tenant
    shape prefix-aware routers are built for, as in llm-d's shared-prefix benchmarks)."""
    if workload == "tenants":
        return Mix(_tenants(tenants), 1.0)
    return Mix(tuple(text(random.Random(100 + i), size)
                     for i, size in enumerate((300, 600, 1000, 1500))), 0.8)


def sim_body(messages: list[dict], seed: int, rng: random.Random) -> dict:
    """A request to the simulator: its outputs stop by themselves under ``max_tokens``."""
    return {"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS, "seed": seed,
            "messages": messages, "stream_options": {"include_usage": True}}


@dataclass
class Workload:
    """Conversations: new ones, and follow-ups that carry their history. ``text`` writes
    about N of the engine's tokens, ``body`` makes a request of the messages; a
    conversation is continued while it has fewer than ``max_messages`` messages (the
    real-vLLM benchmarks' model has a 2,048-token context)."""

    rng: random.Random
    mix: Mix
    open: list[list[dict]] = field(default_factory=list)
    text: Callable[[random.Random, int], str] = text
    body: Callable[[list[dict], int, random.Random], dict] = sim_body
    user_median: int = 120
    user_max: int = 2000
    max_messages: int = 12

    def next(self) -> list[dict]:
        if self.open and self.rng.random() < 0.35:
            history = self.open.pop(self.rng.randrange(len(self.open)))
        else:
            history = ([{"role": "system", "content": self.rng.choice(self.mix.systems)}]
                       if self.rng.random() < self.mix.system_share else [])
        user = min(self.user_max,
                   max(8, round(self.rng.lognormvariate(math.log(self.user_median), 0.8))))
        return [*history, {"role": "user", "content": self.text(self.rng, user)}]

    def request(self, seed: int) -> tuple[list[dict], dict]:
        """The next request's messages and body."""
        messages = self.next()
        return messages, self.body(messages, seed, self.rng)

    def answered(self, messages: list[dict], reply: str) -> None:
        if len(messages) < self.max_messages and len(self.open) < 200:
            self.open.append([*messages, {"role": "assistant", "content": reply}])


# How a refusal given up from Narwhal's queue after a wait ends its message (a refusal on
# arrival does not say it).
GAVE_UP = " ms in the admission queue; retry later"


@dataclass
class Result:
    status: int
    start: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    predicted_s: float | None = None
    tokens: int = 0
    predicted_tokens: int | None = None
    engine: str = ""
    end: float | None = None
    refusal: str = ""  # a refused request's error code and message
    answer_s: float | None = None  # until the response's headers: a refusal's wait
    prompt_tokens: int | None = None  # the engine's usage
    cached: int | None = None  # the prompt tokens the engine found cached (its usage)
    predicted_cached: int | None = None  # x-narwhal-predicted-cached-tokens
    # a refusal's advice: Retry-After, retry-after-ms, x-should-retry (as sent)
    retry_after: str | None = None
    retry_after_ms: str | None = None
    should_retry: str | None = None
    objective: str = ""  # the InferenceObjective it named (``--interactive``), if any
    flow: str = ""  # the fairness ID it named (``--heavy``), if any


# ``--interactive``: the share of requests that name this objective, and its priority in
# every Narwhal policy's admission.objectives (the other routers ignore the header).
INTERACTIVE = "interactive"
INTERACTIVE_PRIORITY = 10


def objective_of(seed: int, interactive: float) -> str:
    """The objective request ``seed`` names: ``INTERACTIVE`` for a share ``interactive``
    of the seeds, drawn from the seed alone (the same requests whatever the policy)."""
    return INTERACTIVE if interactive and random.Random(seed).random() < interactive else ""


# ``--heavy``: two clients of the pool, by fairness ID (x-gateway-inference-fairness-id):
# one sends this share of the requests, the other the rest.
HEAVY, LIGHT = "heavy", "light"


def flow_of(seed: int, heavy: float) -> str:
    """The fairness ID request ``seed`` names with ``--heavy`` (none without): drawn from
    the seed alone, apart from ``objective_of``'s draw."""
    if not heavy:
        return ""
    return HEAVY if random.Random(~seed).random() < heavy else LIGHT


async def labelled(session: aiohttp.ClientSession, url: str, body: dict, seed: int,
                   interactive: float, heavy: float) -> tuple[Result, list[str]]:
    """``stream``, naming the objective and the fairness ID that request ``seed`` draws
    (``--interactive``, ``--heavy``); the result says which."""
    objective, flow = objective_of(seed, interactive), flow_of(seed, heavy)
    headers = {"x-gateway-inference-objective": objective} if objective else {}
    if flow:
        headers["x-gateway-inference-fairness-id"] = flow
    result, reply = await stream(session, url, body, headers)
    result.objective, result.flow = objective, flow
    return result, reply


def class_arguments(parser: argparse.ArgumentParser, priority_on: str, turns_on: str) -> None:
    """The two ways a benchmark splits its clients into classes, each reported apart:
    ``--interactive`` (an objective with a priority) and ``--heavy`` (two fairness IDs);
    ``priority_on``, ``turns_on``: where the benchmark's Narwhal acts on them."""
    parser.add_argument("--interactive", type=float, default=0.0, metavar="SHARE",
                        help=f"this share of requests name the InferenceObjective "
                             f"'{INTERACTIVE}' (priority {INTERACTIVE_PRIORITY} {priority_on}); "
                             "each class is reported apart too")
    parser.add_argument("--heavy", type=float, default=0.0, metavar="SHARE",
                        help=f"two clients by fairness ID: '{HEAVY}' sends this share of the "
                             f"requests, '{LIGHT}' the rest (turns {turns_on}); each class is "
                             "reported apart too")


def class_flags(args: argparse.Namespace) -> str:
    """``class_arguments``' options as given, for a run's reproduce line."""
    return (f"{f' --interactive {args.interactive:g}' if args.interactive else ''}"
            f"{f' --heavy {args.heavy:g}' if args.heavy else ''}")


def apart(results: list[Result], interactive: float, heavy: float
          ) -> list[tuple[str, list[Result]]]:
    """Each class a run drew (``--interactive``: int and rest; ``--heavy``: each client),
    tagged, with its results; a class without any is left out."""
    classes: list[tuple[str, Callable[[Result], bool]]] = []
    if interactive:
        classes += [("int", lambda r: r.objective == INTERACTIVE),
                    ("rest", lambda r: r.objective != INTERACTIVE)]
    if heavy:
        classes += [(flow, lambda r, f=flow: r.flow == f) for flow in (HEAVY, LIGHT)]
    parts = [(tag, [r for r in results if member(r)]) for tag, member in classes]
    return [(tag, part) for tag, part in parts if part]


async def one(session: aiohttp.ClientSession, url: str, work: Workload, seed: int,
              interactive: float = 0.0, heavy: float = 0.0) -> Result:
    messages, body = work.request(seed)
    result, reply = await labelled(session, url, body, seed, interactive, heavy)
    if result.end is not None:
        work.answered(messages, "".join(reply))
    return result


async def stream(session: aiohttp.ClientSession, url: str, body: dict,
                 headers: dict[str, str] | None = None) -> tuple[Result, list[str]]:
    """One streaming request as a client sees it: status, Narwhal's prediction headers,
    the first token's and each later token's arrival, the engine's usage; and the reply's
    text (``end`` is set only when the stream completed). A reply whose tokens decode to
    no text (vLLM sends no event for them; a random-weight model's special tokens) has
    its first token timed at its finishing event: the first the client sees of it, later
    than the token, so never in budget by mistake."""
    start = time.monotonic()
    result = Result(0, start)
    reply: list[str] = []
    try:
        async with session.post(url, data=orjson.dumps(body),
                                headers={"content-type": "application/json",
                                         **(headers or {})}) as resp:
            result.status = resp.status
            result.answer_s = time.monotonic() - start
            predicted = resp.headers.get("x-narwhal-predicted-ttft-ms")
            result.predicted_s = int(predicted) / 1000 if predicted else None
            tokens = resp.headers.get("x-narwhal-predicted-output-tokens")
            result.predicted_tokens = int(tokens) if tokens else None
            result.engine = resp.headers.get("x-sim-engine", "")
            cached = resp.headers.get("x-narwhal-predicted-cached-tokens")
            result.predicted_cached = int(cached) if cached else None
            if resp.status != 200:
                result.retry_after = resp.headers.get("retry-after")
                result.retry_after_ms = resp.headers.get("retry-after-ms")
                result.should_retry = resp.headers.get("x-should-retry")
                try:
                    error = orjson.loads(await resp.read())["error"]
                    result.refusal = f"{error['code']}: {error['message']}"
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    pass
                return result, reply
            first = last = None
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = orjson.loads(line[6:])
                usage = event.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if not piece and choice.get("finish_reason") and first is None:
                        result.ttft_s = time.monotonic() - start
                    if piece:
                        last = time.monotonic()
                        if first is None:  # kept if the client gives up during decode
                            first = last
                            result.ttft_s = first - start
                        result.tokens += 1
                        reply.append(piece)
            result.end = time.monotonic()
            if first is not None and last is not None and result.tokens > 1:
                result.tpot_s = (last - first) / (result.tokens - 1)
    except (TimeoutError, aiohttp.ClientError):
        pass
    return result, reply


# A client gives up after this long (GPU-equivalent: times ``--time-scale``); bounds each
# cell's drain. In GPU-equivalent seconds so that a run at another time scale is the same
# workload: at 120 dilated seconds whatever the scale, a 1.5x run at 24x cut 39% of its
# streams (the h100's 19%) where one at 12x cut 11% (the h100's 0.6%), and the engines
# served another mix of decodes.
CLIENT_TIMEOUT_GPU_S = 10.0


async def drive(url: str, rate: float, duration: float, seed: int, work: Workload,
                timeout_s: float,
                at: tuple[tuple[float, Callable[[], Awaitable[None]]], ...] = (),
                warmup: float = 0.0, interactive: float = 0.0, heavy: float = 0.0
                ) -> list[Result]:
    """Poisson arrivals at ``rate`` for ``warmup`` + ``duration`` s, each given up after
    ``timeout_s``; the requests that arrived during the warm-up are not returned. ``at``:
    (seconds after the warm-up, coroutine function) pairs, started then (counter
    snapshots, the drift)."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t = time.monotonic()
        measured = t + warmup
        end = measured + duration
        # Each action at its own time, arrivals or not (a quiet cell still snapshots).
        tasks = [asyncio.ensure_future(_at(measured + offset, fn)) for offset, fn in at]
        i = 0
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(session, url, work, seed * 100000 + i,
                                                   interactive, heavy)))
            i += 1
        done = await asyncio.gather(*tasks)
        return [r for r in done if isinstance(r, Result) and r.start >= measured]


async def _at(when: float, fn: Callable[[], Awaitable[None]]) -> None:
    await asyncio.sleep(max(0.0, when - time.monotonic()))
    await fn()


def dump(results: list[Result], path: Path) -> None:
    """Per-request samples of a cell, one JSON object a line, for analysis."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r.__dict__) + b"\n" for r in results))


class StatusTrace:
    """Narwhal's /status twice a second through a cell, for analysis (``--samples``)."""

    def __init__(self, stack: Stack, path: Path) -> None:
        self.stack, self.path = stack, path
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("wb") as out, httpx.Client(timeout=5) as client:
            while not self.done.wait(0.5):
                status = client.get(f"{self.stack.admin_url}/status").json()
                out.write(orjson.dumps({"t": time.monotonic(), **status}) + b"\n")

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def ttft_errors(results: list[Result]) -> list[tuple[str, float]]:
    """Each admitted request's engine and relative TTFT prediction error, where it has
    both a first token and a prediction."""
    return [(r.engine, abs(r.predicted_s - r.ttft_s) / r.ttft_s) for r in results
            if r.status == 200 and r.ttft_s is not None and r.predicted_s is not None]


def summarize(results: list[Result], duration: float, budget_s: float, scale: float) -> dict:
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    # admitted (200) but no first token before the client gave up: out of budget too
    admitted = sum(1 for r in results if r.status == 200)
    good = [r for r in ok if r.ttft_s <= budget_s]
    errs = [err for _, err in ttft_errors(results)]
    out_errs = [abs(r.predicted_tokens - r.tokens) / max(1, r.tokens) for r in ok
                if r.predicted_tokens is not None]
    tpots = [r.tpot_s / scale for r in ok if r.tpot_s is not None]
    # Sustained overload: a router without admission control looks fine while its queues
    # fill and serves nothing in budget once they are a budget deep, so the second half of
    # a long cell is its steady state and the whole cell partly its transient.
    half = min((r.start for r in results), default=0.0) + duration / 2
    refused = [r for r in results if r.status in (429, 503)]
    waits = [r.answer_s / scale for r in refused if r.answer_s is not None]
    return {
        "offered": len(results),
        "goodput": len(good) / duration,
        "goodput_late": sum(1 for r in good if r.start >= half) / (duration / 2),
        "in_budget": len(good) / admitted if admitted else float("nan"),
        "ttft50": quantile([r.ttft_s / scale for r in ok], 0.5),
        "ttft90": quantile([r.ttft_s / scale for r in ok], 0.9),
        "ttft99": quantile([r.ttft_s / scale for r in ok], 0.99),
        "tpot50": quantile(tpots, 0.5),
        "tpot99": quantile(tpots, 0.99),
        "refused": len(refused) / max(1, len(results)),
        # of the refusals, those given up from Narwhal's queue after a wait (their message
        # says so), and how long refused clients waited for their answer
        "gave_up": (sum(1 for r in refused if r.refusal.endswith(GAVE_UP))
                    / len(refused) if refused else None),
        "refusal_wait90": quantile(waits, 0.9) if waits else None,
        "other": sum(1 for r in results if r.status not in (200, 429, 503)),
        "err50": quantile(errs, 0.5) if errs else None,
        "err90": quantile(errs, 0.9) if errs else None,
        "mape": sum(errs) / len(errs) if errs else None,
        "out_mape": sum(out_errs) / len(out_errs) if out_errs else None,
    }


def per_engine_errors(results: list[Result]) -> str:
    """Where the prediction's tail is: each engine's p90 and MAPE, and its requests."""
    by: dict[str, list[float]] = {}
    for engine, err in ttft_errors(results):
        by.setdefault(engine, []).append(err)
    return ", ".join(f"{name} {quantile(errs, 0.9):.1%}/{sum(errs) / len(errs):.1%} "
                     f"({len(errs)})" for name, errs in sorted(by.items()))


# The unit of a cell's load, requests/s GPU-equivalent (time scale 1), on chat and tenants
# alike (a load is the same request rate on both). The first calibration (Narwhal open at
# 4x, open-loop) measured 148 but counted the streams Narwhal ended on its stall timeout
# as completions; every figure since is against 148, so it stays the unit. What the pool
# completes depends on which requests it takes: --calibrate (closed-loop, every seat
# taken, no budget) measures 104 (open) and 109 (predictive) with output counted, and
# predictive admission at 1.5x serves 141-147 within the 1 s budget, by taking the
# requests each engine can serve in it (docs/measurements.md, "Twenty-fifth session").
CAPACITY_GPU_RPS = 148.0
SEATS = 256  # each simulator's sequence cap (--max-num-seqs; sim/batching.py's default)


def capacity_rps(scale: float) -> float:
    return CAPACITY_GPU_RPS / scale


def calibrate(args: argparse.Namespace, mix: Mix) -> float:
    """The pool's throughput with every seat taken: clients that each send their next
    request as their last one ends, as many as the engines' sequences and a few more (a
    seat freed is taken at once), through Narwhal (``--calibrate-with``: open, or
    predictive with a budget no request misses) booking at most the cap on each engine,
    with the patience to wait out the slowest engine's full batch; completions with output
    per second over the last two thirds of the run.

    Why closed-loop: an open-loop 4x overload (the first calibration) collapses: the
    engines' own queues grow minutes deep, clients give up on work the engines still
    compute, and Narwhal ends the streams of an engine silent past its stall timeout.
    Counted as completions, those streams made the l4's whole share (one run: 6.0 of 13.5
    a second, none with a token); counted with output, 95.6 req/s GPU-equivalent. Every
    seat taken is no maximum either: the l4's 256 sequences overflow its KV cache."""
    pool = Stack(sims=sims(args.time_scale), model=MODEL).start_sims()
    patience_ms = 600_000
    mode, scheduler = NARWHAL[args.calibrate_with]
    stack = narwhal_stack(pool, mode, patience_ms, scheduler,
                          {"engine_stall_timeout_ms": patience_ms}, overrides=args.set)
    try:
        t0 = time.monotonic()
        results = asyncio.run(saturate(f"{stack.url}/v1/chat/completions",
                                       len(ENGINES) * SEATS + 32, args.duration, args.seed,
                                       Workload(random.Random(args.seed + 1), mix)))
    finally:
        stack.stop()
        pool.stop()
    lo, hi = t0 + args.duration / 3, t0 + args.duration
    done = [r for r in results if r.end is not None and r.tokens and lo <= r.end <= hi]
    rate = {name: sum(1 for r in done if r.engine == name) / (hi - lo) * args.time_scale
            for name, _ in ENGINES}
    print("  completions per engine: " + ", ".join(f"{n} {c:.1f}" for n, c in rate.items())
          + " req/s GPU-equivalent", file=sys.stderr)
    return len(done) / (hi - lo) * args.time_scale


async def saturate(url: str, clients: int, duration: float, seed: int,
                   work: Workload) -> list[Result]:
    """``clients`` closed-loop clients for ``duration`` s, without a client timeout; the
    requests still open then are cancelled (not returned). A refused client waits a
    second before its next request (it would otherwise spin on refusals)."""
    done: list[Result] = []

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        for i in range(1 << 30):
            result = await one(session, url, work, seed * 100000 + k * 10000 + i)
            done.append(result)
            if result.status != 200:
                await asyncio.sleep(1.0)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.ensure_future(client(session, k)) for k in range(clients)]
        await asyncio.sleep(duration)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return done


def sims(scale: float) -> list[SimSpec]:
    return [SimSpec(name, args=["--profile", profile, "--time-scale", str(scale),
                                "--natural-output", str(NATURAL_OUTPUT), "--engine-name", name,
                                "--max-model-len", "16384", "--enable-prompt-tokens-details"])
            for name, profile in ENGINES]


# Prefill bounded in tokens, not requests (docs/measurements.md, "Twenty-seventh session").
TOKEN_BOUND = {"max_prefill_per_engine": 64, "max_prefill_tokens_per_engine": 1536}

# Narwhal's variants: the scheduler settings each adds to the defaults.
NARWHAL = {"predictive": ("predictive", {}), "open": ("open", {}),
           "predictive-noprefix": ("predictive", {"prefix_index_blocks": 0}),
           "open-noprefix": ("open", {"prefix_index_blocks": 0}),
           "predictive-workers2": ("predictive", {}),
           "predictive-affinity": ("predictive", {"scorers": {"ttft": 1.0,
                                                              "prefix-affinity": 0.5}}),
           "predictive-t40": ("predictive", {}),
           "predictive-noprefix-t40": ("predictive", {"prefix_index_blocks": 0}),
           # the least-work order acts on Narwhal's own queue: with at most 1,536 uncached
           # prompt tokens in prefill an engine (three quarters of the profiles' 2,048-token
           # step), not 256 requests, they wait there rather than in the engine's FCFS queue
           "predictive-least-work": ("predictive", TOKEN_BOUND),
           "predictive-noprefix-least-work": ("predictive", {"prefix_index_blocks": 0,
                                                             **TOKEN_BOUND}),
           "predictive-least-work-t40": ("predictive", TOKEN_BOUND),
           "predictive-noprefix-least-work-t40": ("predictive", {"prefix_index_blocks": 0,
                                                                 **TOKEN_BOUND}),
           "predictive-tokens": ("predictive", TOKEN_BOUND),
           "predictive-p8": ("predictive", {"max_prefill_per_engine": 8})}

# Narwhal's variants configured with a TTFT target below the budget the cell measures
# goodput against (a shorter queue under overload: docs/measurements.md, "Twenty-first session").
TARGET_SHARE = {"predictive-t40": 0.4, "predictive-noprefix-t40": 0.4,
                "predictive-least-work-t40": 0.4, "predictive-noprefix-least-work-t40": 0.4}


# Narwhal's variants with an admission setting of their own: the least expected work
# first in the queue (docs/measurements.md, "Twenty-sixth session").
LEAST_WORK = {"queue_order": "least-work"}
ADMISSION = {"predictive-least-work": LEAST_WORK, "predictive-noprefix-least-work": LEAST_WORK,
             "predictive-least-work-t40": LEAST_WORK,
             "predictive-noprefix-least-work-t40": LEAST_WORK}


# Narwhal's variants that change how it is served, not how it schedules.
SERVING = {"predictive-workers2": {"workers": 2}}


def narwhal_stack(pool: Stack, mode: str, budget_ms: int,
                  scheduler: dict | None = None, serving: dict | None = None,
                  admission: dict | None = None,
                  overrides: dict[str, dict] | None = None) -> Stack:
    engines = [{"name": s.name, "url": f"http://127.0.0.1:{s.port}", "dialect": "vllm"}
               for s in pool.sims]
    config = {"admission": {"mode": mode, "ttft_target_ms": budget_ms, "queue_limit": 1024,
                            "retention_limit": 4096, "max_wait_ms": 600_000,
                            "max_ttft_target_ms": 600_000, **(admission or {})},
              "scheduler": {"max_prefill_per_engine": 256, "max_decode_per_engine": 256,
                            **(scheduler or {})},
              "engines": engines}
    for section, values in (overrides or {}).items():
        config[section] = {**config.get(section, {}), **values}
    if serving:
        config["serving"] = {"extproc_socket": str(Path(tempfile.mkdtemp(prefix="nw-"))
                                                   / "x.sock"), **serving}
    stack = Stack(sims=[], config=config, model=MODEL).start()
    profiled(stack)
    return stack


def profiled(stack: Stack, timeout: float = 300.0) -> None:
    """Wait until Narwhal has profiled every engine and may place on it (its /status):
    /ready needs one eligible engine, and a cell that began then measured the others'
    profiles landing during its ramp (the l4's ~20 s in), which the peers, routing to
    every engine from the first request, do not pay."""
    end = time.monotonic() + timeout
    while True:
        engines = httpx.get(f"{stack.admin_url}/status", timeout=10).json()["engines"]
        if all(e["profiled"] and e["eligible"] for e in engines):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"engines not profiled after {timeout:g} s: {engines}")
        time.sleep(0.2)


def sim_metrics(s: SimSpec) -> str:
    """One simulator's /metrics text."""
    return httpx.get(f"http://127.0.0.1:{s.port}/metrics", timeout=10).text


def cache_counters(pool: Stack) -> dict[str, tuple[float, float]]:
    """Each engine's prefix-cache queries and hits so far (tokens), from its metrics."""
    out = {}
    for s in pool.sims:
        values = parse_vllm_metrics(sim_metrics(s))
        out[s.name] = (values.get("prefix_queries", 0.0), values.get("prefix_hits", 0.0))
    return out


def busy_counters(pool: Stack) -> dict[str, tuple[float, float]]:
    """Each engine's seconds in steps and in full steps so far (the simulator's own
    counters), and now (under "")."""
    out = {"": (time.monotonic(), 0.0)}
    for s in pool.sims:
        values = {}
        for line in sim_metrics(s).splitlines():
            if line.startswith("narwhal_sim_"):
                name, value = line.split()
                values[name] = float(value)
        out[s.name] = (values["narwhal_sim_busy_seconds_total"],
                       values["narwhal_sim_full_step_seconds_total"])
    return out


def busy_shares(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    """Per engine, the shares of a window's wall time it spent in steps and in full steps
    (its token budget, sequence cap or KV blocks used up with work left over). A
    continuous-batching engine decoding anything is in steps all the time; one whose
    steps are all full computes at its limit, whatever it computes (in budget or not)."""
    wall = after[""][0] - before[""][0]
    return {n: ((after[n][0] - before[n][0]) / wall, (after[n][1] - before[n][1]) / wall)
            for n in after if n}


def index_counters(stack: Stack) -> dict[str, tuple[float, float]]:
    """Narwhal's prompt tokens dispatched per engine and the part its index expected cached."""
    engines = httpx.get(f"{stack.admin_url}/status", timeout=10).json()["engines"]
    return {e["name"]: (e["index_tokens"], e["index_cached_tokens"]) for e in engines}


def hit_rates(before: dict, after: dict, min_tokens: float = 0.0) -> dict[str, float]:
    """Per engine, over a window: the second counter's share of the first."""
    out = {}
    for name, (q1, h1) in after.items():
        q0, h0 = before.get(name, (0.0, 0.0))
        if q1 - q0 > min_tokens:
            out[name] = (h1 - h0) / (q1 - q0)
    return out


def idle(urls: list[str], timeout: float | None = None) -> None:
    """Wait until every engine at ``urls`` (the simulator's or vLLM's) has nothing
    running or waiting by its own metrics (observable state); ``timeout``: fail after so
    many seconds instead of waiting on."""
    end = None if timeout is None else time.monotonic() + timeout
    for url in urls:
        while True:
            values = parse_vllm_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
            if not values.get("running", 0.0) + values.get("waiting", 0.0):
                break
            if end is not None and time.monotonic() > end:
                raise RuntimeError(f"{url} still busy after {timeout:g} s")
            time.sleep(0.2)


def run_policy(policy: str, loads: list[float], args: argparse.Namespace, mix: Mix,
               workdir: Path) -> list[tuple[str, float, float, dict]]:
    """A fresh pool (cold prefix caches) per policy; the loads in order."""
    pool = Stack(sims=sims(args.time_scale), model=MODEL).start_sims()
    budget_s = args.budget_ms * args.time_scale / 1000
    rows = []
    try:
        stack, scheduler = None, {}
        if policy in NARWHAL:
            mode, scheduler = NARWHAL[policy]
            target_ms = round(budget_s * 1000 * TARGET_SHARE.get(policy, 1.0))
            stack = narwhal_stack(pool, mode, target_ms, scheduler, SERVING.get(policy),
                                  ADMISSION.get(policy), args.set)
            url, stop = f"{stack.url}/v1/chat/completions", stack.stop
        elif policy == "round-robin":
            envoy, port = plain_envoy(REPO_ROOT / "bench" / "envoy-roundrobin.yaml", workdir,
                                      [s.port for s in pool.sims])
            url, stop = f"http://127.0.0.1:{port}/v1/chat/completions", envoy.terminate
        else:
            proc, port = vllm_router([f"http://127.0.0.1:{s.port}" for s in pool.sims],
                                     {"vllm-router-p2": "power_of_two",
                                      "vllm-router-cache": "cache_aware"}[policy], workdir)
            url, stop = f"http://127.0.0.1:{port}/v1/chat/completions", proc.terminate
        try:
            for load in loads:
                rate = load * capacity_rps(args.time_scale)
                marks: dict[str, dict] = {}

                async def measured(stack: Stack | None = stack, marks: dict = marks) -> None:
                    """The warm-up is over: the cell's counters start here."""
                    marks["engines"] = await asyncio.to_thread(cache_counters, pool)
                    marks["index"] = (await asyncio.to_thread(index_counters, stack)
                                      if stack is not None else {})
                    marks["busy"] = await asyncio.to_thread(busy_counters, pool)

                async def arrivals_end(marks: dict = marks) -> None:
                    """The last arrival: the engines' busy time over the cell (not its drain)."""
                    marks["busy_end"] = await asyncio.to_thread(busy_counters, pool)

                watch = (StatusTrace(stack, Path(args.samples) / f"{policy}-{load:g}.status.jsonl")
                         if args.samples and stack is not None else None)
                results = asyncio.run(drive(url, rate, args.duration, args.seed,
                                            Workload(random.Random(args.seed + 1), mix),
                                            CLIENT_TIMEOUT_GPU_S * args.time_scale,
                                            ((0.0, measured), (args.duration, arrivals_end)),
                                            args.warmup, args.interactive, args.heavy))
                before, index0 = marks["engines"], marks["index"]
                if watch is not None:
                    watch.stop()
                row = summarize(results, args.duration, budget_s, args.time_scale)
                busy = busy_shares(marks["busy"], marks["busy_end"])
                row["full"] = sum(f for _, f in busy.values()) / len(busy)
                print("  share of the cell in steps / in full steps: " + ", ".join(
                    f"{n} {b:.0%}/{f:.0%}" for n, (b, f) in busy.items()), file=sys.stderr)
                if stack is not None:
                    print("  prediction p90/MAPE per engine: " + per_engine_errors(results),
                          file=sys.stderr)
                if args.samples:
                    dump(results, Path(args.samples) / f"{policy}-{load:g}.jsonl")
                after = cache_counters(pool)
                queries = sum(a[0] - before[n][0] for n, a in after.items())
                hits = sum(a[1] - before[n][1] for n, a in after.items())
                row["hit"] = hits / queries if queries else None
                if stack is not None and scheduler.get("prefix_index_blocks") != 0:
                    # The index's expectation against each engine's own counters, over the
                    # cell, for engines that served a real share of it.
                    actual = hit_rates(before, after, 20_000)
                    predicted = hit_rates(index0, index_counters(stack), 5_000)
                    gaps = {n: predicted[n] - actual[n] for n in actual if n in predicted}
                    row["hit_gap"] = max(map(abs, gaps.values())) if gaps else None
                    print("  hit rate predicted/engine: " + ", ".join(
                        f"{n} {predicted[n]:.2f}/{actual[n]:.2f}" for n in gaps),
                        file=sys.stderr)
                rows.append((policy, load, rate, row))
                # each class apart: its own goodput and in-budget share
                for tag, part in apart(results, args.interactive, args.heavy):
                    rows.append((f"{policy}:{tag}", load, rate,
                                 summarize(part, args.duration, budget_s, args.time_scale)))
                print(f"  {policy} {load:g}x done", file=sys.stderr, flush=True)
                idle([f"http://127.0.0.1:{s.port}" for s in pool.sims])
        finally:
            stop()
    finally:
        pool.stop()
    return rows


def run_drift(args: argparse.Namespace, mix: Mix, load: float) -> dict:
    """Narwhal predictive; the fastest engine halves its speed at duration / 3."""
    pool = Stack(sims=sims(args.time_scale), model=MODEL).start_sims()
    budget_s = args.budget_ms * args.time_scale / 1000
    mode, scheduler = NARWHAL[args.drift_policy]
    stack = narwhal_stack(pool, mode, round(budget_s * 1000), scheduler,
                          SERVING.get(args.drift_policy), ADMISSION.get(args.drift_policy),
                          args.set)
    name, port = pool.sims[0].name, pool.sims[0].port
    marks: dict[str, float] = {}

    async def slow_down() -> None:
        async with aiohttp.ClientSession() as s:
            resets = await _resets(s, stack, name)
            await s.post(f"http://127.0.0.1:{port}/sim/speed", json={"speed": 0.5})
            marks["drift"] = time.monotonic()
            while time.monotonic() - marks["drift"] < args.duration:
                if await _resets(s, stack, name) > resets:
                    marks["detected"] = time.monotonic()
                    return
                await asyncio.sleep(0.05)

    watch = (StatusTrace(stack, Path(args.samples) / "drift.status.jsonl")
             if args.samples else None)
    try:
        results = asyncio.run(drive(f"{stack.url}/v1/chat/completions",
                                    load * capacity_rps(args.time_scale), args.duration,
                                    args.seed, Workload(random.Random(args.seed + 1), mix),
                                    CLIENT_TIMEOUT_GPU_S * args.time_scale,
                                    ((args.duration / 3, slow_down),)))
    finally:
        if watch is not None:
            watch.stop()
        stack.stop()
        pool.stop()
    if args.samples:
        dump(results, Path(args.samples) / "drift.jsonl")
    t0 = marks.get("drift")
    t1 = marks.get("detected")
    window = [r for r in results if r.engine == name and t0 is not None
              and r.start >= t0 - budget_s and (t1 is None or r.start <= t1)
              and r.status == 200 and r.ttft_s is not None]
    late = [r for r in window if r.ttft_s > budget_s]
    return {"detect_s": (t1 - t0) / args.time_scale if t0 and t1 else None,
            "admitted": len(window), "late": len(late),
            "summary": summarize(results, args.duration, budget_s, args.time_scale)}


async def _resets(session: aiohttp.ClientSession, stack: Stack, name: str) -> int:
    async with session.get(f"{stack.admin_url}/status") as resp:
        status = await resp.json()
    return next(e["drift_resets"] for e in status["engines"] if e["name"] == name)


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == policy]
        a.plot([r[1] for r in mine], [r[3]["goodput"] for r in mine], marker="o", label=policy)
        b.plot([r[1] for r in mine], [100 * r[3]["in_budget"] for r in mine], marker="o",
               label=policy)
    a.set(xlabel="load (x pool capacity)", ylabel="goodput (req/s within TTFT budget)")
    b.set(xlabel="load (x pool capacity)", ylabel="% of admitted within budget", ylim=(0, 101))
    a.legend()
    a.grid(alpha=0.3)
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def settings(items: list[str]) -> dict[str, dict]:
    """``--set`` arguments as config sections: ``scheduler.max_prefill_per_engine=10``
    becomes ``{"scheduler": {"max_prefill_per_engine": 10}}``."""
    out: dict[str, dict] = {}
    for item in items:
        key, eq, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not (eq and dot and section and name):
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        out.setdefault(section, {})[name] = yaml.safe_load(value)
    return out


def _fmt(x: float | None, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.1%}" if pct else f"{x * 1000:.0f}ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per cell")
    parser.add_argument("--loads", default="0.5,1,1.5,2",
                        help="multiples of the load unit (CAPACITY_GPU_RPS)")
    parser.add_argument("--budget-ms", type=int, default=1000,
                        help="TTFT budget, real-GPU-equivalent")
    parser.add_argument("--time-scale", type=float, default=12.0,
                        help="how much slower than the GPU profiles the engines run")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--drift", action="store_true", help="add the drift scenario")
    parser.add_argument("--drift-policy", default="predictive",
                        choices=[p for p in POLICIES if p in NARWHAL],
                        help="the Narwhal policy the drift scenario runs (default predictive)")
    parser.add_argument("--plot", help="write a PNG of goodput and in-budget %% against load")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--samples", default="",
                        help="a folder for each cell's per-request samples and /status "
                             "trace (JSON lines; the drift run's as drift.*)")
    parser.add_argument("--workload", choices=WORKLOADS, default="chat",
                        help="chat: four shared system prompts; tenants: 48 long ones")
    parser.add_argument("--tenants", type=int, default=48,
                        help="applications (system prompts) of the tenants workload")
    parser.add_argument("--warmup", type=float, default=0.0,
                        help="seconds of load at each cell's rate before it is measured")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the pool's throughput with every seat taken, and exit")
    parser.add_argument("--calibrate-with", choices=("open", "open-noprefix", "predictive"),
                        default="open",
                        help="the placement that saturates the pool for --calibrate")
    class_arguments(parser, "in every Narwhal policy",
                    "with --set admission.fairness=round-robin")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a Narwhal setting over every Narwhal policy's own (repeatable; "
                             "VALUE is YAML), e.g. scheduler.max_prefill_per_engine=10")
    args = parser.parse_args()
    try:
        args.set = settings(args.set)
    except ValueError as exc:
        parser.error(str(exc))
    given = {sec: dict(kv) for sec, kv in args.set.items()}  # for the reproduce line
    if args.interactive:  # unless set otherwise (``--set admission.objectives={}``: none)
        args.set.setdefault("admission", {}).setdefault(
            "objectives", {INTERACTIVE: INTERACTIVE_PRIORITY})
    mix = workload_mix(args.workload, args.tenants)
    if args.calibrate:
        print(f"throughput, every seat taken ({args.workload}, {args.calibrate_with}): "
              f"{calibrate(args, mix):.1f} req/s GPU-equivalent "
              f"(CAPACITY_GPU_RPS is {CAPACITY_GPU_RPS:g})")
        return 0
    loads = [float(x) for x in args.loads.split(",")]
    policies = names(parser, args.policies, POLICIES, "policy")
    if any(p.startswith("vllm-router") for p in policies):
        vllm_router_exe()  # before any cell runs
    os.environ.setdefault("NARWHAL_LOOP", "uvloop")
    rows = []
    with scratch("narwhal-sched-") as workdir:
        for policy in policies:
            rows += run_policy(policy, loads, args, mix, workdir)
        drift = run_drift(args, mix, 1.0) if args.drift else None
    print(f"Narwhal scheduling benchmark: engines {', '.join(p for _, p in ENGINES)} at "
          f"time scale {args.time_scale:g}; workload {args.workload}; TTFT budget "
          f"{args.budget_ms} ms; load 1.0 = {capacity_rps(args.time_scale):.2f} req/s "
          f"(times below are GPU-equivalent)")
    sets = "".join(f" --set {sec}.{k}={orjson.dumps(v).decode()}"
                   for sec, kv in given.items() for k, v in kv.items())
    print(f"reproduce: python -m bench.scheduling --duration {args.duration:g} --loads "
          f"{args.loads} --budget-ms {args.budget_ms} --time-scale {args.time_scale:g} "
          f"--policies {args.policies} --seed {args.seed} --workload {args.workload} "
          f"--tenants {args.tenants} --warmup {args.warmup:g}"
          f"{class_flags(args)}"
          f"{' --drift --drift-policy ' + args.drift_policy if args.drift else ''}{sets}")
    print(f"{'policy':19} {'load':>4} {'req/s':>6} {'goodput':>7} {'2nd half':>8} {'in-budget':>9} "
          f"{'TTFT p50':>8} {'p90':>7} {'p99':>7} {'TPOT p50':>8} {'p99':>6} {'refused':>7} "
          f"{'gave up':>7} {'wait p90':>8} "
          f"{'pred p50/p90/MAPE':>19} {'out MAPE':>8} {'hit':>5} {'hit gap':>7} {'full':>5}")
    for policy, load, rate, s in rows:
        err = (f"{_fmt(s['err50'], True)}/{_fmt(s['err90'], True)}/{_fmt(s['mape'], True)}"
               if s["err50"] is not None else "-")
        print(f"{policy:19} {load!s:>4} {rate:6.2f} {s['goodput']:7.2f} {s['goodput_late']:8.2f} "
              f"{s['in_budget']:9.1%} "
              f"{_fmt(s['ttft50']):>8} {_fmt(s.get('ttft90')):>7} {_fmt(s['ttft99']):>7} "
              f"{_fmt(s['tpot50']):>8} {_fmt(s['tpot99']):>6} {s['refused']:7.1%} "
              f"{_fmt(s['gave_up'], True):>7} {_fmt(s['refusal_wait90']):>8} {err:>19} "
              f"{_fmt(s['out_mape'], True):>8} {_fmt(s.get('hit'), True):>5} "
              f"{_fmt(s.get('hit_gap'), True):>7} {_fmt(s.get('full'), True):>5}")
    if drift is not None:
        d = drift["detect_s"]
        print(f"drift ({args.drift_policy}; h100 halves its speed at {args.duration / 3:.0f} s, "
              f"load 1.0): detected "
              f"after {'-' if d is None else f'{d:.1f} s'} (GPU-equivalent); "
              f"{drift['late']}/{drift['admitted']} of its admitted requests out of budget "
              f"meanwhile; run goodput {drift['summary']['goodput']:.2f} req/s, in budget "
              f"{drift['summary']['in_budget']:.1%}")
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
