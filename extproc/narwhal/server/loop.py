"""Event-loop selection: uvloop where it is installed, asyncio's default otherwise.

``NARWHAL_LOOP=asyncio`` selects the default loop, so benchmarks can compare both.
"""

from __future__ import annotations

import asyncio
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
