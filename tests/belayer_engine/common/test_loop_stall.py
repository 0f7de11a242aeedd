"""The loop watch finds a real stall of the event loop (a blocking call on it) and when it began."""

import asyncio
import time

import pytest

from belayer_engine.common.loop_stall import longest_stall

BLOCK_S = 0.08


def test_a_blocking_call_on_the_loop_is_the_longest_stall():
    async def main():
        watch = asyncio.create_task(longest_stall(0.4))
        await asyncio.sleep(0.05)  # the watch runs a while before the loop is blocked
        blocked_at = time.monotonic()
        time.sleep(BLOCK_S)  # blocks the loop: the fault the watch is for
        longest, began = await watch
        return longest, began, blocked_at

    t0 = time.monotonic()
    longest, began, blocked_at = asyncio.run(main())
    assert longest >= BLOCK_S - 0.002, longest
    # it began at the block (seconds from the watch's start), give or take one late wake-up
    assert began <= blocked_at - t0 + 0.002, (began, blocked_at - t0)
    assert began >= 0.0


@pytest.mark.parametrize("duration, tick", [(0, 0.001), (0.1, 0), (-1, 0.001)])
def test_nonpositive_durations_are_refused(duration, tick):
    with pytest.raises(ValueError, match="must be positive"):
        asyncio.run(longest_stall(duration, tick))
