"""Event-loop selection: uvloop where it is installed, asyncio's default otherwise."""

from __future__ import annotations

import asyncio


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
