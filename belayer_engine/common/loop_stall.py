"""How long this event loop went without running: the router's streams and the supervisor's
recovery share one loop, so a stall right after a handover (a blocking call, a spawn) delays
every re-sent request by as much."""

from __future__ import annotations

import asyncio
import time

TICK_S = 0.001


async def longest_stall(duration_s: float, tick_s: float = TICK_S) -> tuple[float, float]:
    """Over the next ``duration_s``: the longest wake-up late by more than a tick, and when it
    began (seconds from the call). Sleeps in ``tick_s`` steps, so it costs ~1/tick_s wake-ups
    a second while it runs."""
    if duration_s <= 0 or tick_s <= 0:
        raise ValueError("duration_s and tick_s must be positive")
    start = last = time.monotonic()
    longest, began = 0.0, 0.0
    while last - start < duration_s:
        await asyncio.sleep(tick_s)
        now = time.monotonic()
        if now - last - tick_s > longest:
            longest, began = now - last - tick_s, last - start
        last = now
    return max(0.0, longest), began
