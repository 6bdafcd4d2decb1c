"""Prefix-aware placement against real vLLM: a pool of two vLLM 0.32 CPU servers with
prefix caching on, caches too small for every tenant's system prompt, under the
multi-tenant load prefix-aware routers are built for; Narwhal against the peers.

    python -m bench.vllm_prefix [--duration S] [--warmup S] [--loads 1,1.5]
        [--budget-ms MS] [--policies ...] [--tenants N] [--blocks N] [--capacity RPS]
        [--samples DIR]

Why it exists: the scheduling benchmark's 48-tenant cells (Narwhal's index and KV
events against ``vllm-router``'s ``cache_aware``) run on ``narwhal sim``, whose caches
and events are written here. Here the caches, their evictions and the events that report
them are vLLM's own. Engines: the real-vLLM tier's random-weight Llama at its "small"
shape (~0.9 ms a prompt token on one thread of this machine: a cached 600-token system
prompt is about half a second less), ``--max-num-seqs 8``, prefix caching on with
128-token blocks (vLLM's CPU default), each publishing its KV-cache events, and each
with ``--blocks`` KV blocks (128: ~16 k tokens, ~6 k of it taken by eight running
sequences): one engine holds about half the tenants' system prompts (~19 k tokens in
all), two hold them all if each tenant goes to one of them. Each engine's worker is
bound to a CPU of its own (vLLM's default binds both to the first: ``own_cpu``); they
share this machine's two cores with Envoy, Narwhal, the peer and the load generator.

Workload: ``--tenants`` (32) applications, each a system prompt (lognormal, median ~600
tokens, 300-1,000); every conversation opens with one; user turns lognormal (median ~60
tokens, at most ~200); 35% of requests continue an earlier conversation with its history
(up to three user turns); ``max_tokens`` lognormal (median 24, at most 96: a random-weight
model seldom stops by itself). Open-loop Poisson at multiples of ``--capacity``, the
pool's throughput under round robin, which the run measures first (16 clients in a
closed loop through Envoy's round robin on a fresh pool).

Policies, each on a fresh pool (cold caches), with ``--warmup`` seconds of load at the
cell's rate before each cell is measured: ``narwhal`` (its defaults, subscribed to the
engines' KV events, the model's tokenizer for exact block keys), ``narwhal-noprefix``
(the same with no prefix knowledge: no events, ``prefix_index_blocks: 0``),
``least-work`` (the goodput settings: least expected work first, at most 1,536 uncached
prompt tokens in prefill an engine; with the events), ``vllm-router-cache``
(``vllm-router`` from PyPI, ``cache_aware``) and ``round-robin`` (Envoy alone). Per
policy and load: goodput (completed within the budget, per second), % of admitted within
it, TTFT p50/p90, refused, Narwhal's TTFT prediction error, and the prompt tokens the
engines found cached (vLLM's own ``cached_tokens`` in each answer's usage, against the
prompt tokens), beside Narwhal's prediction of them (``x-narwhal-predicted-cached-tokens``:
its share, and the share of requests predicted to the token).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from integration.vllm.engine import SERVED_MODEL, VllmServer, built_model, kv_server, own_cpu

from bench import names, run_arguments, scratch, vllm_router
from bench.scheduling import (
    Mix,
    Result,
    StatusTrace,
    Workload,
    _fmt,
    drive,
    dump,
    idle,
    profiled,
    saturate,
    summarize,
)
from bench.vllm_admission import chat_body, output_tokens, prose
from bench.vllm_admission import narwhal_config as admission_config
from narwhal.launch import REPO_ROOT, Stack, plain_envoy

POLICIES = ("narwhal", "narwhal-noprefix", "least-work", "vllm-router-cache", "round-robin")
DEFAULT_POLICIES = ("narwhal", "narwhal-noprefix", "vllm-router-cache", "round-robin")
# A client gives up after this long: a request that late is no use to anyone, and a
# cell's drain (a router without admission control holds seconds of queue) is bounded.
CLIENT_TIMEOUT_S = 30.0


def tenants(n: int) -> tuple[str, ...]:
    """``n`` applications' system prompts: lognormal, median ~600 tokens, 300-1,000 (the
    model's context is 2,048 tokens, and a conversation carries its history)."""
    rng = random.Random(7)
    sizes = [min(1000, max(300, round(rng.lognormvariate(math.log(600), 0.4))))
             for _ in range(n)]
    return tuple(prose(random.Random(300 + i), size) for i, size in enumerate(sizes))


def vllm_body(messages: list[dict], seed: int, rng: random.Random) -> dict:
    return chat_body(messages, output_tokens(rng))


def workload(seed: int, n: int) -> Workload:
    """Conversations over ``n`` tenants' system prompts, sized to the model's context."""
    return Workload(random.Random(seed + 1), Mix(tenants(n), 1.0),
                    text=prose,
                    body=vllm_body, user_median=60, user_max=200, max_messages=6)


@dataclass
class Pool:
    """The two engines of one policy's run (fresh caches)."""

    engines: list[VllmServer]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()


def start_pool(model: Path, workdir: Path, blocks: int, run: int) -> Pool:
    """Two engines over ``model``, prefix caching on, publishing KV events, with
    ``blocks`` KV blocks each; started together (about a minute)."""
    engines = [kv_server(f"vllm-{run}-{i}", model, workdir, own_cpu(i)) for i in range(2)]
    for e in engines:
        e.args += ["--num-gpu-blocks-override", str(blocks)]
        e.spawn()
    for e in engines:
        e.wait()
    return Pool(engines)


def narwhal_config(pool: Pool, policy: str, budget_ms: int, tokenizer: Path) -> dict:
    """Narwhal's configuration for ``policy`` in front of ``pool``: with the model's
    tokenizer (exact block keys), subscribed to the engines' KV events unless blind."""
    blind = policy == "narwhal-noprefix"
    engines = [{k: v for k, v in e.engine_config().items()
                if not (blind and k.startswith("kv_"))} for e in pool.engines]
    return admission_config(engines, budget_ms,
                            "least-work" if policy == "least-work" else "narwhal",
                            {"prefix_index_blocks": 0} if blind else None,
                            sizing={"tokenizer": str(tokenizer)})


def front(policy: str, pool: Pool, budget_ms: int, tokenizer: Path, workdir: Path
          ) -> tuple[str, Stack | None, Callable[[], object]]:
    """The policy's router in front of ``pool``: its chat URL, Narwhal's stack (if it is
    Narwhal) and how to stop it."""
    if policy == "round-robin":
        envoy, port = plain_envoy(REPO_ROOT / "bench" / "envoy-roundrobin.yaml", workdir,
                                  [e.port for e in pool.engines])
        return f"http://127.0.0.1:{port}/v1/chat/completions", None, envoy.terminate
    if policy == "vllm-router-cache":
        proc, port = vllm_router(pool.urls, "cache_aware", workdir)
        return f"http://127.0.0.1:{port}/v1/chat/completions", None, _terminator(proc)
    stack = Stack(sims=[], config=narwhal_config(pool, policy, budget_ms, tokenizer),
                  model=SERVED_MODEL).start()
    profiled(stack)
    return f"{stack.url}/v1/chat/completions", stack, stack.stop


def _terminator(proc: subprocess.Popen) -> Callable[[], object]:
    def stop() -> None:
        proc.terminate()
        proc.wait(timeout=20)
    return stop


def cache_report(results: list[Result]) -> dict:
    """The prompt tokens the engines found cached, from each completed answer's usage:
    their share of the prompt tokens (``hit``); where Narwhal predicted them, its
    predicted share over the same requests (``predicted_hit``, ``actual_hit``) and the
    share of those requests predicted to the token (``exact``)."""
    done = [r for r in results if r.prompt_tokens and r.cached is not None]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    out: dict = {"hit": sum(r.cached or 0 for r in done) / prompt if prompt else None,
                 "predicted_hit": None, "actual_hit": None, "exact": None}
    told = [r for r in done if r.predicted_cached is not None]
    told_prompt = sum(r.prompt_tokens or 0 for r in told)
    if told_prompt:
        out["predicted_hit"] = sum(r.predicted_cached or 0 for r in told) / told_prompt
        out["actual_hit"] = sum(r.cached or 0 for r in told) / told_prompt
        out["exact"] = sum(1 for r in told if r.predicted_cached == r.cached) / len(told)
    return out


def measure_capacity(model: Path, workdir: Path, blocks: int, n: int, seed: int) -> float:
    """Completions with output per second of a fresh pool behind Envoy's round robin, 16
    clients in a closed loop (twice the engines' sequences), over the last 45 of 60 s."""
    pool = start_pool(model, workdir, blocks, 0)
    try:
        url, _, stop = front("round-robin", pool, 0, model / "tokenizer.json", workdir)
        try:
            t0 = time.monotonic()
            results = asyncio.run(saturate(url, 16, 60.0, seed, workload(seed, n)))
        finally:
            stop()
    finally:
        pool.stop()
    lo, hi = t0 + 15.0, t0 + 60.0
    return sum(1 for r in results if r.end is not None and r.tokens and lo <= r.end <= hi) / (
        hi - lo)


def run_policy(policy: str, loads: list[float], capacity: float, args: argparse.Namespace,
               model: Path, workdir: Path, run: int) -> list[tuple[str, float, dict]]:
    pool = start_pool(model, workdir, args.blocks, run)
    rows = []
    try:
        url, stack, stop = front(policy, pool, args.budget_ms, model / "tokenizer.json",
                                 workdir)
        try:
            for load in loads:
                name = f"{policy}-{load:g}"
                trace = (StatusTrace(stack, Path(args.samples) / f"{name}.status.jsonl")
                         if stack is not None and args.samples else None)
                results = asyncio.run(drive(url, load * capacity, args.duration, args.seed,
                                            workload(args.seed, args.tenants),
                                            CLIENT_TIMEOUT_S, warmup=args.warmup))
                if trace is not None:
                    trace.stop()
                if args.samples:
                    dump(results, Path(args.samples) / f"{name}.jsonl")
                row = summarize(results, args.duration, args.budget_ms / 1000, 1.0)
                rows.append((policy, load, row | cache_report(results)))
                print(f"  {name} done", file=sys.stderr, flush=True)
                idle(pool.urls, timeout=120.0)
        finally:
            stop()
    finally:
        pool.stop()
    return rows


def report(rows: list[tuple[str, float, dict]], duration: float) -> list[str]:
    """The table: one line per policy and load."""
    lines = [f"{'policy':17} {'load':>4} {'req/s':>6} {'goodput':>7} {'in-budget':>9} "
             f"{'TTFT p50':>8} {'p90':>7} {'refused':>7} {'other':>5} {'pred p90/MAPE':>13} "
             f"{'cached':>6} {'predicted/found':>15} {'exact':>6}"]
    for policy, load, s in rows:
        err = (f"{_fmt(s['err90'], True)}/{_fmt(s['mape'], True)}"
               if s["err50"] is not None else "-")
        told = (f"{_fmt(s['predicted_hit'], True)}/{_fmt(s['actual_hit'], True)}"
                if s["predicted_hit"] is not None else "-")
        exact = _fmt(s["exact"], True) if s["exact"] is not None else "-"
        cached = _fmt(s["hit"], True) if s["hit"] is not None else "-"
        lines.append(
            f"{policy:17} {load:>4g} {s['offered'] / duration:6.2f} {s['goodput']:7.2f} "
            f"{s['in_budget']:9.1%} {_fmt(s['ttft50']):>8} {_fmt(s['ttft90']):>7} "
            f"{s['refused']:7.1%} {s['other']:5d} {err:>13} {cached:>6} {told:>15} {exact:>6}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=90.0, help="measured seconds a cell")
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="seconds of load at the cell's rate before it is measured")
    parser.add_argument("--loads", default="1,1.5",
                        help="multiples of the pool's throughput under round robin")
    parser.add_argument("--budget-ms", type=int, default=3000, help="TTFT budget")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help=f"some of {', '.join(POLICIES)}")
    parser.add_argument("--tenants", type=int, default=32, help="applications (system prompts)")
    parser.add_argument("--blocks", type=int, default=128,
                        help="KV blocks an engine (128 tokens each)")
    parser.add_argument("--capacity", type=float, default=0.0,
                        help="the pool's requests/s under round robin (measured if absent)")
    run_arguments(parser)
    args = parser.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    policies = names(parser, args.policies, POLICIES, "policy")
    rows = []
    with scratch("narwhal-vllm-prefix-") as workdir:
        model = built_model(workdir / "model", "small")
        capacity = args.capacity or measure_capacity(model, workdir, args.blocks,
                                                     args.tenants, args.seed)
        print(f"  capacity {capacity:.2f} req/s", file=sys.stderr, flush=True)
        for run, policy in enumerate(policies, 1):
            rows += run_policy(policy, loads, capacity, args, model, workdir, run)
    print(f"Prefix-aware placement against real vLLM (CPU, model 'small', two engines, "
          f"{args.blocks} KV blocks of 128 tokens each, {args.tenants} tenants): TTFT budget "
          f"{args.budget_ms} ms; pool throughput under round robin {capacity:.2f} req/s"
          f"{' (given)' if args.capacity else ' (measured)'}")
    print(f"reproduce: python -m bench.vllm_prefix --duration {args.duration:g} --warmup "
          f"{args.warmup:g} --loads {args.loads} --budget-ms {args.budget_ms} --capacity "
          f"{capacity:.2f} --policies {args.policies} --tenants {args.tenants} --blocks "
          f"{args.blocks} --seed {args.seed}")
    print("\n".join(report(rows, args.duration)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
