"""Talking to local processes over TCP: a free port to give a child, a health probe.

Below every part of the engine: the supervisor and each backend's launcher probe the
processes they start with ``http_status``; benchmarks pick ports with ``free_port``.
"""

from __future__ import annotations

import socket

import aiohttp


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def http_status(session: aiohttp.ClientSession, url: str, timeout: float = 2.0) -> tuple[int, dict]:
    """Status and JSON object body of ``GET url`` (an empty dict for any other body)."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        try:
            body = await resp.json(content_type=None)
        except ValueError:
            body = {}
        return resp.status, body if isinstance(body, dict) else {}
