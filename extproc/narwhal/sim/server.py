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
        body = {"object": "list", "data": [{"id": self.opts.model, "object": "model",
                                            "created": 0, "owned_by": "narwhal-sim",
                                            "root": self.opts.model, "max_model_len": 32768}]}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'{{model_name="{self.opts.model}"}}'
        usage = self.running / max(1, self.timing.max_num_seqs)
        text = (
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {self.running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} {self.waiting}\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{labels} {usage}\n"
            f"# TYPE vllm:prompt_tokens_total counter\n"
            f"vllm:prompt_tokens_total{labels} {self.prompt_tokens_total}\n"
            f"# TYPE vllm:generation_tokens_total counter\n"
            f"vllm:generation_tokens_total{labels} {self.generation_tokens_total}\n"
        )
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
        except (orjson.JSONDecodeError, SimRequestError) as exc:
            err = {"error": {"message": str(exc), "type": "BadRequestError",
                             "param": getattr(exc, "param", None), "code": 400}}
            return web.Response(status=400, body=orjson.dumps(err), content_type="application/json")
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
            elif kind == "token" and paced:
                if pending:
                    await resp.write(b"".join(pending))
                    pending.clear()
                await asyncio.sleep(self.tpot_s())
            if kind == "abort":
                if pending:
                    await resp.write(b"".join(pending))
                if request.transport is not None:
                    request.transport.abort()
                return resp
            if kind in ("first", "token"):
                self.generation_tokens_total += 1
            pending.append(data)
        if pending:
            await resp.write(b"".join(pending))
        await resp.write_eof()
        return resp


def run(host: str, port: int, opts: SimOptions, timing: Timing) -> None:
    from ..server.loop import install_uvloop

    install_uvloop()
    engine = Engine(opts, timing)
    web.run_app(engine.app(), host=host, port=port, access_log=None, print=None,
                handle_signals=True)
