"""Told when to return: clients that retry Narwhal's refusals as the official OpenAI client
does, in front of real vLLM, by which of the refusal's hints they read.

    python -m bench.vllm_retries [--duration S] [--warmup S] [--loads 1,1.5]
        [--hints ms,seconds,none] [--budget-ms MS] [--capacity RPS] [--samples DIR]

Why it exists: a refused request is told when to come back (``Retry-After``, the
projected overrun rounded to whole seconds, at least 1, as the seed's table has it; and
``retry-after-ms``, the overrun unrounded), and the official OpenAI clients act on it by
themselves: every 429 is retried, twice by default, after ``retry-after-ms`` if present,
else ``Retry-After``, else an exponential backoff (0.5 s, then 1 s, less up to 25%
jitter), unless ``x-should-retry: false``. Whether the hint is precise shows in what
those retries meet: refused again (it came back too early), admitted and in budget, and
how long its user waited in all.

Engine, workload and Narwhal as ``bench.vllm_admission`` (vLLM's CPU build, the "small"
random-weight model, single-turn streaming chat, Narwhal's defaults with a TTFT target
of ``--budget-ms``). Each user request is a chain of attempts, arriving open-loop
(Poisson at the load times the engine's saturated throughput) and retried by the rule
above with the hints a client reads (``--hints``): ``ms`` (``retry-after-ms`` first: the
OpenAI Python client since it learnt the header), ``seconds`` (``Retry-After`` only:
clients that read the standard header; all Narwhal said before ``retry-after-ms``),
``overrun`` (the overrun itself, read from the refusal's message: ``retry-after-ms`` as it
was first written, without the floor of a second), ``none`` (the backoff alone: what a
router without hints gets). One Narwhal serves every
cell, the hint modes interleaved at each load, each cell after a warm-up at its load.

Per cell: chains and attempts per second; the share of chains refused at their first
attempt; of those, the share served after retrying, in budget, and their wait from first
attempt to first token (p50/p90); retries admitted (of retries sent); the promise (% of
admitted attempts within the budget) and goodput (chains served in budget per second).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench import names, scratch
from bench.scheduling import Result, _fmt, dump, quantile, stream
from bench.vllm_admission import capacity_of, cell_arguments, drive, narwhal, start_engine

HINTS = ("ms", "seconds", "overrun", "none")
OVERRUN = re.compile(r" by (\d+) ms")  # the refusal's message: the overrun, unrounded
# The OpenAI Python client's rule (openai 3.63, ``_base_client``): its defaults.
MAX_RETRIES = 2
INITIAL_RETRY_DELAY = 0.5
MAX_RETRY_DELAY = 8.0
MAX_RETRY_AFTER_DELAY = 120.0
RETRIED_STATUSES = (0, 408, 409, 429)  # and every 5xx; 0: the connection failed


@dataclass
class Chain:
    """One user request: its attempts, and the wait before each retry."""

    attempts: list[Result] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)

    @property
    def start(self) -> float:
        return self.attempts[0].start

    @property
    def last(self) -> Result:
        return self.attempts[-1]

    @property
    def served(self) -> bool:
        return self.last.status == 200 and self.last.ttft_s is not None

    def waited_s(self) -> float | None:
        """From the first attempt to the first token, retries and their waits included."""
        if not self.served:
            return None
        assert self.last.ttft_s is not None
        return self.last.start + self.last.ttft_s - self.attempts[0].start


def retry_delay(result: Result, hints: str, retries_taken: int,
                rng: random.Random) -> float | None:
    """Seconds until the retry of ``result``, as the OpenAI client decides it reading
    ``hints``; None: it does not retry (the status, ``x-should-retry: false``, or a hint
    past two minutes)."""
    if result.should_retry == "false":
        return None
    if result.status not in RETRIED_STATUSES and result.status < 500:
        return None
    read = {"ms": (("retry_after_ms", 1000.0), ("retry_after", 1.0)),
            "overrun": (("overrun", 1000.0), ("retry_after", 1.0)),
            "seconds": (("retry_after", 1.0),), "none": ()}[hints]
    for attr, divisor in read:
        if attr == "overrun":
            found = OVERRUN.search(result.refusal)
            value = found.group(1) if found else None
        else:
            value = getattr(result, attr)
        if value is None:
            continue
        try:
            delay = float(value) / divisor
        except ValueError:
            continue
        if delay > MAX_RETRY_AFTER_DELAY:
            return None
        if delay > 0:
            return delay
        break
    backoff = min(INITIAL_RETRY_DELAY * 2.0 ** retries_taken, MAX_RETRY_DELAY)
    return backoff * (1 - 0.25 * rng.random())


async def chain(session: aiohttp.ClientSession, url: str, body: dict, hints: str,
                rng: random.Random) -> Chain:
    out = Chain()
    while True:
        result, _ = await stream(session, url, body)
        out.attempts.append(result)
        if result.status == 200 or len(out.attempts) > MAX_RETRIES:
            return out
        delay = retry_delay(result, hints, len(out.attempts) - 1, rng)
        if delay is None:
            return out
        out.waits.append(delay)
        await asyncio.sleep(delay)


def report(chains: list[Chain], duration: float, budget_s: float) -> dict:
    """A cell's figures (see the module's docstring)."""
    attempts = [a for c in chains for a in c.attempts]
    admitted = [a for a in attempts if a.status == 200]
    in_budget = [a for a in admitted if a.ttft_s is not None and a.ttft_s <= budget_s]
    refused_first = [c for c in chains if c.attempts[0].status != 200]
    recovered = [c for c in refused_first if c.served]
    retries = [a for c in chains for a in c.attempts[1:]]
    good = [c for c in chains if c.served and c.last.ttft_s is not None
            and c.last.ttft_s <= budget_s]
    good_ids = {id(c) for c in good}
    waited = [w for c in recovered if (w := c.waited_s()) is not None]
    hints = [w for c in chains for w in c.waits]
    return {
        "chains": len(chains) / duration,
        "attempts": len(attempts) / duration,
        "refused_first": len(refused_first) / max(1, len(chains)),
        "recovered": len(recovered) / len(refused_first) if refused_first else float("nan"),
        "recovered_in_budget": (sum(1 for c in recovered if id(c) in good_ids)
                                / len(refused_first)
                                if refused_first else float("nan")),
        "waited50": quantile(waited, 0.5),
        "waited90": quantile(waited, 0.9),
        "retries": len(retries),
        "retries_admitted": (sum(1 for a in retries if a.status == 200) / len(retries)
                             if retries else float("nan")),
        "hint50": quantile(hints, 0.5),
        "in_budget": len(in_budget) / len(admitted) if admitted else float("nan"),
        "goodput": len(good) / duration,
        "served": sum(1 for c in chains if c.served) / max(1, len(chains)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hints", default=",".join(HINTS),
                        help="which of a refusal's hints the clients read")
    cell_arguments(parser)
    args = parser.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    modes = names(parser, args.hints, HINTS, "hint mode")
    budget_s = args.budget_ms / 1000
    rows = []
    with scratch("narwhal-vllm-") as workdir:
        engine = start_engine(workdir)
        try:
            capacity = capacity_of(engine, args.capacity)
            stack = narwhal(engine, args.budget_ms)
            try:
                url = f"{stack.url}/v1/chat/completions"
                for load in loads:
                    for hints in modes:
                        jitter = random.Random(args.seed + 2)
                        chains = asyncio.run(drive(
                            url, load * capacity, args.warmup, args.duration, args.seed,
                            functools.partial(chain, hints=hints, rng=jitter)))
                        if args.samples:
                            dump([a for c in chains for a in c.attempts],
                                 Path(args.samples) / f"{hints}-{load:g}.jsonl")
                        rows.append((hints, load, report(chains, args.duration, budget_s)))
                        print(f"  {hints}-{load:g} done", file=sys.stderr)
            finally:
                stack.stop()
        finally:
            engine.stop()
    print(f"Clients retrying as the OpenAI client does (max_retries {MAX_RETRIES}), by the "
          f"hints they read, Narwhal in front of real vLLM (CPU, model 'small'): TTFT budget "
          f"{args.budget_ms} ms; engine capacity {capacity:.2f} req/s"
          f"{' (given)' if args.capacity else ' (measured)'}")
    print(f"reproduce: python -m bench.vllm_retries --duration {args.duration:g} --warmup "
          f"{args.warmup:g} --loads {args.loads} --hints {args.hints} --budget-ms "
          f"{args.budget_ms} --capacity {capacity:.2f} --seed {args.seed}")
    print(f"{'hints':8} {'load':>4} {'users/s':>7} {'tries/s':>7} {'refused':>7} "
          f"{'hint p50':>8} {'retries':>7} {'retry ok':>8} {'recovered':>9} {'in budget':>9} "
          f"{'wait p50':>8} {'p90':>6} {'promise':>7} {'goodput':>7}")
    for hints, load, r in rows:
        print(f"{hints:8} {load:>4g} {r['chains']:7.2f} {r['attempts']:7.2f} "
              f"{r['refused_first']:7.1%} {_fmt(r['hint50']):>8} {r['retries']:7d} "
              f"{_fmt(r['retries_admitted'], True):>8} {_fmt(r['recovered'], True):>9} "
              f"{_fmt(r['recovered_in_budget'], True):>9} {_fmt(r['waited50']):>8} "
              f"{_fmt(r['waited90']):>6} {_fmt(r['in_budget'], True):>7} {r['goodput']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
