"""Waiting with a deadline for a peer that may have stopped reading."""

from __future__ import annotations

import asyncio


async def within(aw, timeout: float):
    """``aw``'s result if it comes within ``timeout`` s, else ``TimeoutError`` (``aw`` cancelled). Not
    ``asyncio.wait_for``: before Python 3.12 it swallows a cancellation that arrives as ``aw`` completes."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait([task], timeout=timeout)
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise TimeoutError
    return task.result()
