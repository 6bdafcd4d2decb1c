"""The process's run time: the event loop (uvloop where it is installed, asyncio's default
otherwise), and the heap once start-up is over and once engines join.

``NARWHAL_LOOP=asyncio`` selects the default loop, so benchmarks can compare both.
"""

from __future__ import annotations

import asyncio
import gc
import os


def install_uvloop() -> bool:
    if os.environ.get("NARWHAL_LOOP", "uvloop") == "asyncio":
        return False
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def started() -> int:
    """Start-up is over: collect its garbage once (imports leave a few thousand cyclic
    objects) and move everything it built (modules, configuration, tokenizers, the pool)
    out of the cyclic collector's sight, where a full collection no longer walks it.
    Serving leaves nothing for the collector (a finished request is freed by reference
    counting), so what ``python_gc_objects_collected_total`` counts from here on is a
    leak's sign. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def joined() -> int:
    """Engines joined the pool after start-up (discovery): freeze again, for the same
    reason. What an engine holds grows with serving, above all its prefix index (an
    ``OrderedDict`` of up to ``scheduler.prefix_index_blocks`` block hashes, and the
    KV-event index's as many): unfrozen, every full collection walked every entry of
    every discovered engine's index, 56-165 ms for 64 full ones on this machine, a pause
    of every request in the process every ~10,000 requests. Frozen with them are the
    requests in flight at that moment; they are freed by reference counting when they
    end, as any request is (none leaves a cycle: ``tests/test_lifetimes.py``), and the
    collection first leaves no garbage to freeze. Returns the objects frozen."""
    return started()
