"""The simulator's HTTP face: vLLM's routes, pacing, concurrency and transport faults.

Timing model: a request waits for one of ``max_num_seqs`` slots (vLLM's waiting
queue); prefill is one FIFO server of ``prefill_tps`` tokens/s shared by all requests
(as one GPU's prefill compute is), so a request's first token comes after the prompts
ahead of it and its own; then ``tpot_ms * (1 + batch_slowdown * (running - 1))`` per
further token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import orjson
from aiohttp import web

from .generate import (
    FAULTS,
    OUTPUTS,
    SimOptions,
    SimRequestError,
    full_response,
    make_plan,
    stream_events,
)

log = logging.getLogger("narwhal.sim")


@dataclass(slots=True)
class Timing:
    prefill_tps: float = 0.0
    tpot_ms: float = 0.0
    max_num_seqs: int = 256
    batch_slowdown: float = 0.0
    slow_start_ms: float = 1500.0


class Engine:
    def __init__(self, opts: SimOptions, timing: Timing) -> None:
        self.opts = opts
        self.timing = timing
        self.slots = asyncio.Semaphore(timing.max_num_seqs)
        self.running = 0
        self.waiting = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0
        self.prefill_free_at = 0.0

    def tpot_s(self) -> float:
        t = self.timing
        return t.tpot_ms / 1000.0 * (1.0 + t.batch_slowdown * max(0, self.running - 1))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        card = {"id": self.opts.model, "object": "model", "created": now, "owned_by": "vllm",
                "root": self.opts.model, "parent": None, "max_model_len": self.opts.max_model_len,
                "permission": [{"id": f"modelperm-{now:016x}", "object": "model_permission",
                                "created": now, "allow_create_engine": False,
                                "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
        return web.Response(body=orjson.dumps({"object": "list", "data": [card]}),
                            content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        """vLLM's exposition: HELP and TYPE lines, ``engine`` and ``model_name`` labels,
        float values."""
        labels = f'{{engine="0",model_name="{self.opts.model}"}}'
        usage = self.running / max(1, self.timing.max_num_seqs)
        rows = (
            ("num_requests_running", "gauge", "Number of requests in model execution batches.",
             self.running),
            ("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             self.waiting),
            ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("prefix_cache_queries_total", "counter",
             "Prefix cache queries, in terms of number of queried tokens.",
             self.prompt_tokens_total),
            ("prefix_cache_hits_total", "counter",
             "Prefix cache hits, in terms of number of cached tokens.", 0),
            ("prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             self.prompt_tokens_total),
            ("generation_tokens_total", "counter", "Number of generation tokens processed.",
             self.generation_tokens_total),
        )
        text = "".join(f"# HELP vllm:{name} {doc}\n# TYPE vllm:{name} {kind}\n"
                       f"vllm:{name}{labels} {float(value)!r}\n"
                       for name, kind, doc, value in rows)
        return web.Response(text=text, content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        fault = request.headers.get("x-sim-fault")
        output = request.headers.get("x-sim-output")
        try:
            if fault is not None and fault not in FAULTS:
                raise SimRequestError(f"unknown x-sim-fault {fault!r}", None)
            if output is not None and output not in OUTPUTS:
                raise SimRequestError(f"unknown x-sim-output {output!r}", None)
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise SimRequestError("body must be a JSON object")
            is_chat = request.path.endswith("/chat/completions")
            if is_chat != ("messages" in body):
                raise SimRequestError("messages is required" if is_chat else "prompt is required",
                                      "messages" if is_chat else "prompt")
            plan = make_plan(body, self.opts, fault, output)
        except orjson.JSONDecodeError as exc:
            return _error(SimRequestError(f"invalid JSON body: {exc}"))
        except SimRequestError as exc:
            return _error(exc)
        if plan.stream_error is not None and not plan.stream:
            return _error(plan.stream_error)
        self.requests_total += 1
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        self.prompt_tokens_total += plan.prompt_tokens
        try:
            if plan.stream:
                return await self._stream(request, plan)
            await self._prefill(plan)
            tokens = sum(len(c) for c in plan.choices)
            delay = self.tpot_s() * max(0, tokens // max(1, plan.n) - 1)
            if delay:
                await asyncio.sleep(delay)
            self.generation_tokens_total += tokens
            return web.Response(body=orjson.dumps(full_response(plan)),
                                content_type="application/json")
        finally:
            self.running -= 1
            self.slots.release()

    async def _prefill(self, plan) -> None:
        delay = 0.0
        if self.timing.prefill_tps:
            now = asyncio.get_running_loop().time()
            start = max(now, self.prefill_free_at)
            self.prefill_free_at = start + plan.prompt_tokens / self.timing.prefill_tps
            delay = self.prefill_free_at - now
        if plan.fault == "slow-start":
            delay += self.timing.slow_start_ms / 1000.0
        if delay:
            await asyncio.sleep(delay)

    async def _stream(self, request: web.Request, plan) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8",
                                           "cache-control": "no-cache"})
        await resp.prepare(request)
        paced = self.timing.tpot_ms > 0
        pending: list[bytes] = []
        for kind, data in stream_events(plan):
            if kind == "first":
                # vLLM emits the role chunk with the first token, after prefill.
                await self._prefill(plan)
            elif kind in ("token", "skip") and paced:
                if pending:
                    await resp.write(b"".join(pending))
                    pending.clear()
                await asyncio.sleep(self.tpot_s())
            if kind == "stall":
                if pending:
                    await resp.write(b"".join(pending))
                    pending.clear()
                await asyncio.sleep(3600)  # until the peer gives up and the task is cancelled
            if kind == "abort":
                if pending:
                    await resp.write(b"".join(pending))
                if request.transport is not None:
                    request.transport.abort()
                return resp
            if kind in ("first", "token", "skip"):
                self.generation_tokens_total += 1
            if data:
                pending.append(data)
        if pending:
            await resp.write(b"".join(pending))
        await resp.write_eof()
        return resp


def _error(exc: SimRequestError) -> web.Response:
    return web.Response(status=exc.status, body=orjson.dumps(exc.envelope()),
                        content_type="application/json")


def run(host: str, port: int, opts: SimOptions, timing: Timing) -> None:
    from ..server.loop import install_uvloop

    install_uvloop()
    engine = Engine(opts, timing)
    web.run_app(engine.app(), host=host, port=port, access_log=None, print=None,
                handle_signals=True)
