"""Connections to workers: one left idle is dropped before the worker would close it (SGLang's
uvicorn closes after 5 s idle), so no request is ever sent on a connection the worker is
closing at that moment (a reset, then a failed request on a healthy worker)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

from belayer_engine.common.net import WORKER_KEEPALIVE_S, worker_connector

SGLANG_KEEPALIVE_S = 5.0  # SGLang's SGLANG_TIMEOUT_KEEP_ALIVE default


def test_an_idle_worker_connection_is_dropped_before_the_worker_closes_it():
    assert WORKER_KEEPALIVE_S < SGLANG_KEEPALIVE_S

    async def scenario(make_connector) -> set:
        peers: set = set()

        async def handle(request: web.Request) -> web.Response:
            peers.add(request.transport.get_extra_info("peername"))
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/", handle)
        runner = web.AppRunner(app, keepalive_timeout=60)  # the worker would keep it a minute
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"
        try:
            async with aiohttp.ClientSession(connector=make_connector()) as session:
                for _ in range(2):
                    async with session.get(url) as resp:
                        await resp.read()
                    await asyncio.sleep(WORKER_KEEPALIVE_S + 0.5)  # the idle time under test
        finally:
            await runner.cleanup()
        return peers

    assert len(asyncio.run(scenario(aiohttp.TCPConnector))) == 1, "aiohttp alone reuses it (15 s)"
    assert len(asyncio.run(scenario(worker_connector))) == 2, "the second request went out on a new connection"


def test_a_port_for_a_child_is_one_the_kernel_never_hands_out_by_itself():
    """An SGLang server binds its HTTP port ~30 s after the engine chose it; an ephemeral port
    could be taken meanwhile by any bind(0) or outgoing connection (a server starting beside
    it took one: EADDRINUSE)."""
    from belayer_engine.common.net import _ephemeral_range, child_ports, free_port

    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert ports <= set(child_ports()) and not any(low <= p <= high for p in ports)
    assert not any(10002 <= p <= 19999 or 22000 <= p <= 29999 for p in ports), "Ray's and SGLang's own ranges"
    for port in ports:  # free now: a child can bind it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
