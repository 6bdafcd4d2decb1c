"""What matching a long prompt against engines' reported KV blocks costs, in process.

    python -m bench.kv_match [--tokens N] [--engines E] [--walks W]

Placement projects a request on every engine with KV events (``kv_events``), and again
at each of the queue's walks while the request waits; each projection matches the
prompt's token IDs against the engine's reported blocks. This builds E such engines
(each has reported one block), a ticket with an N-token prompt held as the scheduler
holds it, and projects the ticket on every engine W times. It prints the memory the
ticket's IDs take (``tracemalloc``) and each walk's time: the first, and the median of
the rest.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc

import msgspec

from narwhal.config import parse
from narwhal.core.kv_events import PromptKeys
from narwhal.core.placement import project
from narwhal.core.router import Router
from narwhal.core.scheduler import Ticket

BLOCK = 16  # vLLM's block size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=250_000)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--walks", type=int, default=5)
    args = parser.parse_args()
    now = 100.0
    router = Router(parse({"engines": [
        {"name": f"e{i}", "url": f"http://127.0.0.{i + 1}:8000",
         "kv_events": f"tcp://127.0.0.{i + 1}:5557"} for i in range(args.engines)]}),
        clock=lambda: now)
    rng = random.Random(1)
    ids = [rng.randrange(1000, 150_000) for _ in range(args.tokens)]
    stored = {"type": "BlockStored", "block_hashes": [b"a"], "parent_block_hash": None,
              "token_ids": ids[:BLOCK], "block_size": BLOCK, "lora_id": None,
              "medium": "GPU", "lora_name": None}
    for e in router.engines:
        e.healthy = e.checked = e.profiled = True
        e.telemetry_at = now
        router.pool.observe_kv_events(e, msgspec.msgpack.encode([1.0, [stored], 0]), now)
    router.started = True
    tracemalloc.start()
    t = Ticket(object(), args.tokens, now, 1.0, now + 60)
    t.prompt_ids = PromptKeys(ids)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    walks = []
    for _ in range(args.walks):
        start = time.perf_counter()
        for e in router.engines:
            project(e, t, now=now)
        walks.append(time.perf_counter() - start)
    rest = statistics.median(walks[1:]) if len(walks) > 1 else float("nan")
    print(f"a {args.tokens:,}-token prompt's IDs held in {held / 2**20:.2f} MiB; "
          f"projected on {args.engines} engines with KV events: the first walk "
          f"{walks[0] * 1e3:.1f} ms, then {rest * 1e3:.2f} ms (median of {args.walks - 1})")
    print(f"reproduce: python -m bench.kv_match --tokens {args.tokens} "
          f"--engines {args.engines} --walks {args.walks}")


if __name__ == "__main__":
    main()
