"""The simulator's HTTP face: vLLM's routes, step pacing, and transport faults.

Timing comes from ``batching.BatchScheduler`` (continuous batching, chunked prefill,
KV blocks with preemption, prefix caching). One task runs the engine's steps: it plans
a step, sleeps for the step's cost (times ``time_scale``, divided by the runtime
``speed`` knob), then wakes the requests that got a token. Request handlers wait for
their sequence's progress and write what the engine has produced.

A request reaches the scheduler after an intake, as in vLLM: its API server reads the
request, renders and tokenizes the prompt and hands it to the engine core, which takes
new requests in only between steps. Measured on vLLM 0.32 (CPU build, idle engine, its
own ``time_to_first_token`` less its queue and prefill times): 2.1 ms for a 27-token
prompt, 2.4 ms for 517. So a request sent late in a step joins the step after next, not
the next one, which is what a router that follows the engine's steps from outside must
allow for (without an intake every request the simulator received joined the very next
step, and a model of the steps that assumed so was right here and wrong on vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from typing import Any

import orjson
from aiohttp import web

from .batching import BLOCK_SIZE, BatchScheduler, Intake, Seq, block_hashes
from .generate import (
    FAULTS,
    OUTPUTS,
    Plan,
    SimOptions,
    SimRequestError,
    full_response,
    make_plan,
    pydantic_error,
    stream_events,
)

log = logging.getLogger("narwhal.sim")
PROMPT_BYTES_PER_TOKEN = 4  # generate.count_prompt_tokens
DRIBBLE_S = 0.001  # the ``dribble`` fault's pause after each byte (uvloop's timers count ms)
KEEPALIVE = b": keepalive\n\n"  # the ``keepalive`` fault's comment, every KEEPALIVE_S
KEEPALIVE_S = 0.1


def _hashes(plan: Plan) -> tuple[list[int], list[int]]:
    """The chained block hashes of the prompt and of the reply that continues it, and the
    tokens computed when each block is full: over the rendered text (the prompt at 4
    bytes a token, then the reply's text token by token), or over the token IDs of a
    token prompt and of the reply. The reply is the first choice's, while it is plain
    text (content or completion text): what a follow-up turn renders back."""
    reply = plan.choices[0] if plan.n == 1 and plan.choices else []
    if not plan.prompt_text:
        ids = plan.prompt_token_ids + [tok.id for tok in reply]
        return block_hashes(array("q", ids).tobytes(), 8 * BLOCK_SIZE), []
    data = bytearray(plan.prompt_text.encode())
    size = PROMPT_BYTES_PER_TOKEN * BLOCK_SIZE
    prompt_blocks = len(data) // size
    ends: list[int] = []  # the rendered text's length after each reply token
    for tok in reply:
        if tok.kind not in ("content", "text"):
            break
        data += tok.piece.encode()
        ends.append(len(data))
    hashes = block_hashes(bytes(data), size)
    full_at = [(i + 1) * BLOCK_SIZE for i in range(prompt_blocks)]
    k = 0
    for i in range(prompt_blocks, len(hashes)):
        while ends[k] < (i + 1) * size:
            k += 1
        full_at.append(plan.prompt_tokens + k + 1)
    return hashes, full_at


class Engine:
    def __init__(self, opts: SimOptions, sched: BatchScheduler, slow_start_ms: float = 1500.0,
                 time_scale: float = 1.0, intake: Intake | None = None) -> None:
        self.opts = opts
        self.sched = sched
        self.slow_start_ms = slow_start_ms
        self.time_scale = time_scale
        self.intake = intake if intake is not None else Intake()
        self.speed = 1.0  # runtime knob (POST /sim/speed): drift
        # POST /sim/hold: no step runs while set (tests hold requests before their first
        # token and synchronise on it, instead of on timing)
        self.running = asyncio.Event()
        self.running.set()
        self.requests_total = 0
        self.steps = 0
        # Seconds spent in steps, as run (times time_scale, over speed), and those in full
        # steps: the benchmarks read them (/metrics) to tell an engine computing at its
        # limit from one with room (an engine decoding anything is always in a step).
        self.busy_s = 0.0
        self.full_s = 0.0  # of which in full steps (``StepResult.full``)
        self.waiters: dict[Seq, asyncio.Event] = {}
        self.kick = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def _start(self, app: web.Application) -> None:
        self.task = asyncio.create_task(self._run())

    async def _stop(self, app: web.Application) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _run(self) -> None:
        """The engine's step loop. A step that ends late is not made up by the next one
        sleeping less than zero, but the following ones catch up (throughput is kept)."""
        loop = asyncio.get_running_loop()
        end = loop.time()
        while True:
            if not self.running.is_set():
                await self.running.wait()
                end = loop.time()
                continue
            if not self.sched.busy():
                self.kick.clear()
                await self.kick.wait()
                end = loop.time()
                continue
            result = self.sched.step()
            self.steps += 1
            busy = result.seconds * self.time_scale / self.speed
            self.busy_s += busy
            if result.full:
                self.full_s += busy
            now = loop.time()
            end = max(end + busy, now)
            await asyncio.sleep(end - now)
            for seq in result.progressed:
                event = self.waiters.get(seq)
                if event is not None:
                    event.set()

    def _admit(self, plan: Plan) -> Seq:
        hashes, full_at = _hashes(plan)
        seq = Seq(prompt=plan.prompt_tokens, max_out=max(1, sum(len(c) for c in plan.choices)),
                  hashes=hashes, full_at=full_at)
        self.waiters[seq] = asyncio.Event()
        self.sched.add(seq)
        self.kick.set()
        return seq

    def _retire(self, seq: Seq) -> None:
        self.sched.abort(seq)  # no-op once finished
        self.waiters.pop(seq, None)

    async def _until(self, seq: Seq, tokens: int) -> None:
        event = self.waiters[seq]
        while seq.out < tokens:
            event.clear()
            await event.wait()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/sim/speed", self.set_speed)
        app.router.add_post("/sim/hold", self.set_hold)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def set_speed(self, request: web.Request) -> web.Response:
        """The simulator's drift knob: ``{"speed": 0.5}`` halves the engine's speed."""
        try:
            speed = float(orjson.loads(await request.read())["speed"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return _error(SimRequestError('body must be {"speed": <number>}', "speed"))
        if not 0 < speed < 1000:
            return _error(SimRequestError("speed must be in (0, 1000)", "speed"))
        self.speed = speed
        return web.Response(body=orjson.dumps({"speed": speed}), content_type="application/json")

    async def set_hold(self, request: web.Request) -> web.Response:
        """``{"hold": true}`` stops the engine between steps (requests are accepted and
        wait, none progresses); ``{"hold": false}`` resumes it."""
        try:
            hold = orjson.loads(await request.read())["hold"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            hold = None
        if hold.__class__ is not bool:
            return _error(SimRequestError('body must be {"hold": true|false}', "hold"))
        if hold:
            self.running.clear()
        else:
            self.running.set()
        return web.Response(body=orjson.dumps({"hold": hold}), content_type="application/json")

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
        sched = self.sched
        rows = (
            ("num_requests_running", "gauge", "Number of requests in model execution batches.",
             len(sched.running)),
            ("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             len(sched.waiting)),
            ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             sched.kv_usage),
            ("prefix_cache_queries_total", "counter",
             "Prefix cache queries, in terms of number of queried tokens.", sched.queries),
            ("prefix_cache_hits_total", "counter",
             "Prefix cache hits, in terms of number of cached tokens.", sched.hits),
            ("num_preemptions_total", "counter", "Cumulative number of preemption from the "
             "engine.", sched.preemptions),
            ("prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             sched.prompt_tokens),
            ("generation_tokens_total", "counter", "Number of generation tokens processed.",
             sched.generation_tokens),
        )
        text = "".join(f"# HELP vllm:{name} {doc}\n# TYPE vllm:{name} {kind}\n"
                       f"vllm:{name}{labels} {float(value)!r}\n"
                       for name, kind, doc, value in rows)
        # vLLM's info gauge for its cache configuration (the values are labels).
        text += ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                 "# TYPE vllm:cache_config_info gauge\n"
                 f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",enable_prefix_caching='
                 f'"{sched.prefix_caching}",engine="0",num_gpu_blocks="{sched.num_gpu_blocks}"'
                 "} 1.0\n")
        # The simulator's own (no vLLM metric says how busy an engine is; Narwhal does not
        # read it: the benchmarks do).
        text += ("# HELP narwhal_sim_busy_seconds_total Seconds the engine spent in steps, "
                 "as run (times --time-scale, over the speed knob).\n"
                 "# TYPE narwhal_sim_busy_seconds_total counter\n"
                 f"narwhal_sim_busy_seconds_total {self.busy_s!r}\n"
                 "# HELP narwhal_sim_full_step_seconds_total Of those, seconds in steps that "
                 "ran out of room (token budget, sequence cap or KV blocks) with work left.\n"
                 "# TYPE narwhal_sim_full_step_seconds_total counter\n"
                 f"narwhal_sim_full_step_seconds_total {self.full_s!r}\n")
        return web.Response(text=text, content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        fault = request.headers.get("x-sim-fault", self.opts.fault)
        output = request.headers.get("x-sim-output")
        try:
            if fault is not None and fault not in FAULTS:
                raise SimRequestError(f"unknown x-sim-fault {fault!r}", None)
            if output is not None and output not in OUTPUTS:
                raise SimRequestError(f"unknown x-sim-output {output!r}", None)
            body = _json_body(request.content_type, raw)
            is_chat = request.path.endswith("/chat/completions")
            if is_chat != ("messages" in body):
                raise SimRequestError("messages is required" if is_chat else "prompt is required",
                                      "messages" if is_chat else "prompt")
            plan = make_plan(body, self.opts, fault, output,
                             request.headers.get("x-request-id"))
        except UnicodeDecodeError:  # what FastAPI answers before vLLM's handlers run
            return web.json_response({"detail": "There was an error parsing the body"},
                                     status=400)
        except SimRequestError as exc:
            return _error(exc)
        if plan.stream_error is not None and not plan.stream:
            return _error(plan.stream_error)
        self.requests_total += 1
        delay = self.intake.seconds(plan.prompt_tokens) * self.time_scale
        if delay > 0:
            await asyncio.sleep(delay)
        if plan.stream:
            return await self._stream(request, plan)
        seq = self._admit(plan)
        try:
            await self._until(seq, seq.max_out)
            plan.cached_tokens = seq.cached_tokens
        finally:
            self._retire(seq)
        if plan.fault == "slow-start":
            await asyncio.sleep(self.slow_start_ms / 1000)
        return web.Response(body=orjson.dumps(full_response(plan)),
                            content_type="application/json", headers=self._own_headers())

    def _own_headers(self) -> dict[str, str]:
        return {"x-sim-engine": self.opts.engine_name} if self.opts.engine_name else {}

    async def _stream(self, request: web.Request, plan: Plan) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8",
                                           "cache-control": "no-cache", **self._own_headers()})
        await resp.prepare(request)
        seq = self._admit(plan) if plan.stream_error is None else None
        pending: list[bytes] = []
        produced = 0  # generated tokens this response has shown
        try:
            for kind, data in stream_events(plan):
                if kind in ("first", "token", "skip") and seq is not None:
                    produced += 1
                    if seq.out < produced:
                        if pending:
                            await resp.write(b"".join(pending))
                            pending.clear()
                        await self._until(seq, produced)
                    plan.cached_tokens = seq.cached_tokens  # the usage event comes last
                    if kind == "first" and plan.fault == "slow-start":
                        await asyncio.sleep(self.slow_start_ms / 1000)
                if kind == "stall":
                    if pending:
                        await resp.write(b"".join(pending))
                        pending.clear()
                    await asyncio.sleep(3600)  # until the peer gives up and the task is cancelled
                if kind == "keepalive":
                    if pending:
                        await resp.write(b"".join(pending))
                        pending.clear()
                    while True:  # until the peer gives up and the task is cancelled
                        await resp.write(KEEPALIVE)
                        await asyncio.sleep(KEEPALIVE_S)
                if kind == "abort":
                    if pending:
                        await resp.write(b"".join(pending))
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                if data and plan.fault == "dribble":
                    # A byte at a time, each its own write and HTTP chunk, paused so that
                    # the proxy reads each on its own: a broken engine's (or proxy's) pace.
                    for at in range(len(data)):
                        try:
                            await resp.write(data[at:at + 1])
                        except ConnectionError:
                            return resp  # the router ended the request
                        await asyncio.sleep(DRIBBLE_S)
                    continue
                if data:
                    pending.append(data)
            if pending:
                await resp.write(b"".join(pending))
            await resp.write_eof()
        finally:
            if seq is not None:
                self._retire(seq)
        return resp


def _json_body(content_type: str, raw: bytes) -> dict[str, Any]:
    """The request body as vLLM's API server reads it: JSON only (else 400), and its
    validation's wording for a body that is not one object."""
    if content_type != "application/json":
        raise SimRequestError("1 validation error:\n  Unsupported Media Type: Only "
                              "'application/json' is allowed", kind="Bad Request")
    if not raw:
        raise pydantic_error("body", "missing", "Field required")
    raw.decode("utf-8")  # UnicodeDecodeError: FastAPI's own answer
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise pydantic_error(f"body.{exc.pos}", "json_invalid", "JSON decode error") from None
    if not isinstance(body, dict):
        raise pydantic_error("body", "model_attributes_type", "Input should be a valid "
                             "dictionary or object to extract fields from")
    return body


def _error(exc: SimRequestError) -> web.Response:
    return web.Response(status=exc.status, body=orjson.dumps(exc.envelope()),
                        content_type="application/json")


def run(host: str, port: int, opts: SimOptions, sched: BatchScheduler,
        slow_start_ms: float = 1500.0, time_scale: float = 1.0,
        intake: Intake | None = None) -> None:
    from ..server.loop import install_uvloop

    install_uvloop()
    engine = Engine(opts, sched, slow_start_ms, time_scale, intake)
    # A client that leaves cancels its handler, which aborts its sequence (as vLLM does).
    web.run_app(engine.app(), host=host, port=port, access_log=None, print=None,
                handle_signals=True, handler_cancellation=True)
