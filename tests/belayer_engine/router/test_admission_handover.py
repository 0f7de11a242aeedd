"""A recovery never waits on the promoted worker's ``/get_server_info``: the slot's successor
is sent work at once on what its last worker said, and its own read comes later, after the
handover (it would cross that server's HTTP side and scheduler while they take the re-sent
requests). The worker here is a real aiohttp server that answers the first read and holds
every later one."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from belayer_engine.common.routing import Endpoint, RoutingTable
from belayer_engine.router.admission import Admission

INFO = {"max_running_requests": 2, "num_blocks": 8, "page_size": 16}


async def _server(reads: list[float], held: asyncio.Event, hold: asyncio.Event) -> web.AppRunner:
    async def info(request):
        reads.append(asyncio.get_running_loop().time())
        if len(reads) > 1:
            held.set()
            await hold.wait()  # a server just promoted, slow to answer (until the test ends)
        return web.json_response(INFO)

    app = web.Application()
    app.router.add_get("/get_server_info", info)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def test_a_promoted_worker_takes_a_recovery_before_its_capacity_is_read():
    async def main():
        reads: list[float] = []
        held, hold = asyncio.Event(), asyncio.Event()
        runner = await _server(reads, held, hold)
        port = runner.addresses[0][1]
        table = RoutingTable()
        table.add_slot("w0")
        async with aiohttp.ClientSession() as session:
            delay = 2.0
            admission = Admission(table, session, max_waiting=16, info_timeout_s=600, successor_read_delay_s=delay)
            first = Endpoint(slot="w0", url=f"http://127.0.0.1:{port}")
            await table.put_in_service(first)
            assert await admission.enter(64, "a", timeout=5) is first  # capacity read: 2 running, 128 tokens
            await table.mark_down("w0", "killed")
            second = Endpoint(slot="w0", url=f"http://127.0.0.1:{port}")
            await table.put_in_service(second)
            routed = asyncio.get_running_loop().time()
            got = await asyncio.wait_for(admission.enter(64, "b", timeout=5), 5)  # the read of it hangs
            assert got is second
            await asyncio.wait_for(held.wait(), 5 + delay)  # its own read was sent and is still unanswered
            assert len(reads) == 2 and reads[1] - routed >= delay, "the successor's read came after the handover"
            # the slot's limits hold for the successor: 128 tokens, one more generation of 64 fits, not two
            assert await asyncio.wait_for(admission.enter(64, "c", timeout=5), 5) is second
            blocked = asyncio.ensure_future(admission.enter(64, "d", timeout=5))
            await asyncio.sleep(0)
            assert not blocked.done()
            admission.leave(second, 64)
            assert await asyncio.wait_for(blocked, 5) is second
            hold.set()
        await runner.cleanup()

    asyncio.run(main())
