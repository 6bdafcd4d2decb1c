"""Subscribing to engines' KV-cache events (``engines[].kv_events``) over ZMQ.

vLLM binds its publisher (``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'``); Narwhal connects one SUB socket per
engine, so the connection names the engine. Each message is ``[topic, seq, payload]``.
What the sequence and the payload mean is the core's (``KvBlocks.sequence``: a gap
forgets the reported blocks, a restart at 0 starts a complete history;
``Pool.observe_kv_events``); this loop only reads, bounded: ZMQ drops a message over
``MAX_PAYLOAD`` bytes before it is read.

With the engine's replay socket (``engines[].kv_replay``, vLLM's ``replay_endpoint``),
batches missed are asked for again: on subscribing, everything after the last batch seen
(the whole buffer, the first time: a Narwhal started after the engine learns what it
already holds), and whenever a live batch shows a gap (a PUB socket drops what is sent
before the subscription reaches it, or past the high-water mark) or comes behind the last
(a restart whose first batches were lost: from 0). The replay is a DEALER
request, ``[b"", start_seq]``, answered by ``[b"", topic, seq, payload]`` per buffered
batch and ``[b"", b"", -1, b""]`` at the end; it is bounded in batches and in time, and
whatever it cannot recover is a gap as before. A replay socket that does not answer is
not asked again for ``REPLAY_QUIET_S`` (live batches wait while a replay runs).
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from ..core.engines import EngineState
from ..core.kv_events import KvEventError, Replay
from ..core.router import Router

log = logging.getLogger("narwhal.kv_events")
MAX_PAYLOAD = 16 * 1024 * 1024
RCV_HWM = 10_000


RESUBSCRIBE_S = (1.0, 30.0)  # the first and the longest wait before subscribing again
REPLAY_S = 5.0  # the longest wait for a replay's next answer (vLLM polls every 0.1 s)
REPLAY_TOTAL_S = 60.0  # the longest a whole replay may hold the live batches back
REPLAY_QUIET_S = 30.0  # after a replay socket did not answer, no replay for this long
MAX_REPLAY = 100_000  # batches one replay may apply (vLLM buffers 10,000 by default)


class KvSubscribers:
    """One subscriber task per engine with KV events, for the pool as it is: engines that
    join (discovery) get one, engines that leave lose theirs. ``sync`` runs at start and
    whenever the router's state changes (it is one of the router's listeners)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.tasks: dict[int, tuple[EngineState, asyncio.Future[None]]] = {}

    def sync(self) -> None:
        present = {id(e): e for e in self.router.engines if e.kv is not None}
        for key, (_, task) in list(self.tasks.items()):
            if key not in present or task.done():
                task.cancel()
                del self.tasks[key]
        for key, e in present.items():
            if key not in self.tasks:
                self.tasks[key] = (e, asyncio.ensure_future(kv_events_loop(self.router, e)))

    def cancel(self) -> list[asyncio.Future[None]]:
        tasks = [task for _, task in self.tasks.values()]
        for task in tasks:
            task.cancel()
        self.tasks.clear()
        return tasks


async def kv_events_loop(router: Router, engine: EngineState) -> None:
    """Subscribe until the engine has no KV state any more. A subscriber that fails for a
    reason nobody foresaw subscribes again after a backoff (meanwhile, and until its
    events are live again, the engine's prefix is the approximate index's): the failure
    must neither take the router down nor end the engine's events for good."""
    loop = asyncio.get_running_loop()
    wait: float | None = None
    while True:
        began = loop.time()
        try:
            await _subscribe(router, engine)
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            wait = resubscribe_wait(wait, loop.time() - began)
            log.exception("engine %s: KV event subscriber failed; subscribing again in "
                          "%.0f s", engine.name, wait)
        await asyncio.sleep(wait)


def resubscribe_wait(previous: float | None, ran_s: float) -> float:
    """The wait after a failure: the first wait, doubled for each failure that follows
    closely on the last, and the first again after a subscription that ran longer than
    the longest wait (a new fault days later is not the old one repeating, and must not
    cost the doubled wait)."""
    first, longest = RESUBSCRIBE_S
    if previous is None or ran_s > longest:
        return first
    return min(longest, 2 * previous)


async def _subscribe(router: Router, engine: EngineState) -> None:
    """Read the engine's events until it has no KV state (returns) or something fails
    (raises)."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD)
    sock.setsockopt(zmq.RCVHWM, RCV_HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(engine.config.kv_events)
    log.info("engine %s: KV events from %s", engine.name, engine.config.kv_events)
    warned = 0
    replay = engine.config.kv_replay
    loop = asyncio.get_running_loop()
    quiet_until = 0.0  # a replay socket that did not answer is not asked again until then
    try:
        # Subscribed first, then the replay: nothing falls between.
        if replay and engine.kv is not None and not await _replay(
                router, engine, engine.kv.resume()):
            quiet_until = loop.time() + REPLAY_QUIET_S
        while True:
            parts = await sock.recv_multipart()
            kv = engine.kv
            if kv is None:
                return
            if len(parts) != 3 or len(parts[1]) != 8:
                kv.failed()
                continue
            seq = int.from_bytes(parts[1], "big", signed=True)
            if kv.duplicate(seq):
                continue
            missed = kv.missing(seq) if replay and loop.time() >= quiet_until else None
            if missed is not None and not await _replay(router, engine, missed):
                quiet_until = loop.time() + REPLAY_QUIET_S  # live batches wait meanwhile
            try:
                router.pool.observe_kv_events(engine, parts[2], router.clock(), seq)
            except KvEventError as exc:
                if warned < 10:  # an engine that keeps sending garbage does not flood logs
                    warned += 1
                    log.warning("engine %s: unreadable KV event batch: %s", engine.name, exc)
    finally:
        sock.close(linger=0)


async def _replay(router: Router, engine: EngineState, replay: Replay) -> bool:
    """Apply the engine's buffered batches that ``replay`` takes. Stops at the first
    answer it does not take, at ``MAX_REPLAY`` batches, when no answer came within
    ``REPLAY_S`` or the whole replay took ``REPLAY_TOTAL_S``: what
    is not recovered stays missed, and the next batch's sequence says so. False when the
    socket did not answer in time (live batches waited meanwhile: not again soon)."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.config.kv_replay)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + REPLAY_TOTAL_S
    applied = 0
    start = replay.start
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        while applied < MAX_REPLAY:
            left = min(REPLAY_S, deadline - loop.time())
            if left <= 0 or not await sock.poll(left * 1000, zmq.POLLIN):
                log.warning("engine %s: KV event replay from %d timed out after %d batches;"
                            " none for %.0f s", engine.name, start, applied, REPLAY_QUIET_S)
                return False
            parts = await sock.recv_multipart()
            if len(parts) != 4 or parts[0] or len(parts[2]) != 8:
                log.warning("engine %s: unreadable KV event replay answer", engine.name)
                return True
            seq = int.from_bytes(parts[2], "big", signed=True)
            if not replay.takes(seq):
                return True  # the end, out of order, or caught up with the live batch
            if engine.kv is None:
                return True
            try:
                router.pool.observe_kv_events(engine, parts[3], router.clock(), seq, True)
            except KvEventError as exc:
                log.warning("engine %s: unreadable replayed KV event batch: %s",
                            engine.name, exc)
            applied += 1
            if applied % 64 == 0:
                await asyncio.sleep(0)  # a long replay shares the loop with the data path
        return True
    finally:
        sock.close(linger=0)
        if applied:
            log.info("engine %s: %d KV event batches replayed from %d", engine.name,
                     applied, start)
