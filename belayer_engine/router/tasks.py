"""Coroutines run side by side for one client request (its ``n`` choices, its batch): the
first error cancels the others, so no generation outlives the request that asked for it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any


async def gather_all(coros: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run ``coros`` concurrently; the first error cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
