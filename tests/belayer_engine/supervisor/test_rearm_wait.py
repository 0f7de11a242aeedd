"""The new shadow's spawn waits for the requests a handover re-sent: spawning blocks the
loop they leave from."""

import asyncio

from belayer_engine.common.routing import Endpoint
from belayer_engine.supervisor.supervisor import resends_settled


def test_the_spawn_waits_until_every_resent_request_has_a_token():
    async def main():
        endpoint = Endpoint(slot="w0", url="http://127.0.0.1:1")
        endpoint.replaying = 2
        waiter = asyncio.create_task(resends_settled(endpoint, min_s=0.0, cap_s=60.0, poll_s=0.001))
        for _ in range(20):  # it keeps waiting while any re-sent request has no token
            await asyncio.sleep(0.002)
            assert not waiter.done()
        endpoint.replaying = 1
        await asyncio.sleep(0.01)
        assert not waiter.done()
        endpoint.replaying = 0  # the last one's first token
        await asyncio.wait_for(waiter, 10)

    asyncio.run(main())


def test_the_wait_ends_at_its_cap_when_a_request_never_gets_a_token():
    async def main():
        endpoint = Endpoint(slot="w0", url="http://127.0.0.1:1")
        endpoint.replaying = 1
        await asyncio.wait_for(resends_settled(endpoint, min_s=0.0, cap_s=0.05, poll_s=0.001), 10)
        await asyncio.wait_for(resends_settled(None, min_s=0.0), 10)  # a cold start: no endpoint yet

    asyncio.run(main())
