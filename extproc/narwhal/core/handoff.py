"""An exchange that leaves the scheduler process for the worker that holds its stream.

With ``serving.workers`` the scheduler process admits and places every request, and the
exchange it built is sent upstream from there. The response phase (every token event)
is the expensive part, and it needs nothing shared but a few ``Control`` calls: so the
scheduler hands the worker what the response phase reads, once per request, and the
worker rebuilds an exchange in the same state. Plain data (msgpack-able lists and
numbers): no object crosses the process boundary.

What is handed over is what ``Exchange`` reads after ``_upstream``: the request's
facts (not its body: only its ``model`` is reported), the engine and its fallbacks,
the ticket's predictions and times, the deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .engines import EngineState
from .exchange import Exchange, Phase
from .request import CompletionRequest
from .router import Router
from .scheduler import Ticket

EngineFor = Callable[[str, str], EngineState]  # (name, endpoint) -> an engine to name


def snapshot(ex: Exchange) -> list[Any]:
    """What a worker needs to drive ``ex`` from its upstream phase on."""
    if not ex.completion:
        return [False, ex.path, ex.request_ended]
    req, t, e = ex.request, ex.ticket, ex.engine
    assert req is not None and t is not None and e is not None and ex.meter is not None
    return [
        True, ex.path, ex.request_ended, ex.request_id,
        [req.chat, str(req.body.get("model", "")), req.stream, req.include_usage,
         req.return_token_ids, req.prompt_bytes, req.max_tokens, req.ids_compatible],
        ex.meter.token_ids, [e.name, e.endpoint],
        [[f.name, f.endpoint] for f in t.fallbacks],
        [t.tokens, t.arrival, t.budget_s, t.deadline, t.dispatched_at, t.predicted_ttft_s,
         t.predicted_output, t.predicted_cached, t.failover],
        [ex.arrival, ex.deadline, ex.budget_s, ex.tpot_budget_s, ex.decided_at],
        [list(h) for h in ex.trace_headers],
    ]


def resume(router: Router, snap: list[Any], engine_for: EngineFor) -> Exchange:
    """The exchange ``snapshot`` described, in the upstream phase, driven by ``router``
    (a worker's, whose ``control`` reports to the scheduler)."""
    ex = Exchange(router)
    ex.phase = Phase.UPSTREAM
    ex.completion, ex.path, ex.request_ended = bool(snap[0]), str(snap[1]), bool(snap[2])
    if not ex.completion:
        return ex
    ex.request_id = snap[3]
    chat, model, stream, include_usage, return_ids, prompt_bytes, max_tokens, ids_ok = snap[4]
    ex.request = CompletionRequest(chat, {"model": model}, stream, include_usage, return_ids,
                                   prompt_bytes, max_tokens, ids_ok)
    ex.sized = True
    ex.engine = engine_for(*snap[6])
    tokens, arrival, budget_s, deadline, dispatched_at, predicted, output, cached, \
        failover = snap[8]
    ex.ticket = Ticket(ex, tokens, arrival, budget_s, deadline, engine=ex.engine,
                       dispatched_at=dispatched_at, predicted_ttft_s=predicted,
                       predicted_output=output, predicted_cached=cached,
                       fallbacks=tuple(engine_for(n, p) for n, p in snap[7]),
                       failover=failover)
    ex.arrival, ex.deadline, ex.budget_s, ex.tpot_budget_s, ex.decided_at = snap[9]
    ex.trace_headers = tuple((k, v) for k, v in snap[10])
    ex.expect_response(bool(snap[5]))
    ex.wake_at = ex.deadline  # until response headers, the deadline is what it waits on
    return ex
