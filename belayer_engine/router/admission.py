"""Admission: the router sends a worker only what it can hold; the rest waits here.

A worker handed more generations than it runs queues them silently. One batched body of
256 prompts x n=16 became 4,096 streams on one reference worker: its event loop served
thousands of streams, its ``/health`` slowed past the stall probe's timeout, and the busy
worker was taken for a dead one and handed over (issue 47, item 4). A generation waiting
here has not been sent: no stall clock runs for it and no worker can be blamed for it.

Capacity: each endpoint's ``/get_server_info``, read once (reference worker:
``max_running_requests`` and ``num_blocks`` x ``page_size``; SGLang: ``internal_states[0]``'s
``effective_max_running_requests_per_dp`` and ``memory_usage.token_capacity``); what an
endpoint does not tell is not limited. An endpoint is sent at most twice what it runs (one
batch running, the next ready for its scheduler) and no more tokens than its KV holds: a
generation reserves its tokens (prompt, the ids it re-sends, the budget left, rounded up to
whole KV pages) on the least loaded endpoint where both fit. A worker that answers 429
itself (SGLang's ``--max-queued-requests``, the reference worker's ``--max-queued``) lowers
that endpoint's count to what it holds; the generation waits here again, nobody is blamed.

Fairness: waiting generations are served round-robin by client request (``group``), so a
small request waits for one generation of a large batch, not for all of them; the request
whose turn it is waits until its generation fits (nothing starves).

Limits: a generation larger than every worker's KV is a 400 naming both numbers; a request
that would make more than ``max_waiting`` generations wait is a 429 (``Overloaded``).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

import aiohttp

from belayer_core.errors import BelayerError, Overloaded, UsageError
from belayer_engine.common.routing import Endpoint, RoutingTable

_TICK_S = 0.25  # how often waiters look for endpoints that appeared (a handover) or came back
# A promoted worker's own capacity is read this long after the router first routes to it,
# not at once: the read goes through its HTTP side and its scheduler, which are taking the
# re-sent requests then (a CPU profile of an SGLang handover: ~20 ms of that server's HTTP
# loop building the answer, and a scheduler round trip, mid-adoption).
SUCCESSOR_READ_DELAY_S = 3.0


@dataclass
class Capacity:
    """What one worker holds at once; None: not limited. ``inflight``: generations sent to it
    (twice what it runs: one batch running, the next ready for its scheduler)."""

    inflight: int | None = None
    tokens: int | None = None
    page: int = 1

    def cost(self, tokens: int) -> int:
        return -(-tokens // self.page) * self.page


def _positive(value) -> int | None:
    return value if type(value) is int and value > 0 else None


def capacity_of(info: dict) -> Capacity:
    """A worker's capacity from its ``/get_server_info`` (reference worker or SGLang)."""
    running = _positive(info.get("max_running_requests"))
    page = _positive(info.get("page_size")) or 1
    blocks = _positive(info.get("num_blocks"))
    tokens = blocks * page if blocks else None
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        state = states[0]
        running = _positive(state.get("effective_max_running_requests_per_dp")) or running
        usage = state.get("memory_usage")
        if isinstance(usage, dict):
            tokens = _positive(usage.get("token_capacity")) or tokens
    return Capacity(inflight=2 * running if running else None, tokens=tokens, page=page)


@dataclass
class _Load:
    capacity: Capacity | None = None  # None while it is being read
    sent: int = 0  # generations in flight on it
    tokens: int = 0
    learning: asyncio.Task | None = None


@dataclass(eq=False)
class _Waiter:
    tokens: int
    future: asyncio.Future


class Admission:
    """Per-endpoint reservations and the router's fair queue (one per router, on its loop)."""

    def __init__(self, table: RoutingTable, session: aiohttp.ClientSession, max_waiting: int,
                 info_timeout_s: float, successor_read_delay_s: float = SUCCESSOR_READ_DELAY_S) -> None:
        self.table = table
        self.session = session
        self.max_waiting = max_waiting
        self.info_timeout_s = info_timeout_s
        self.successor_read_delay_s = successor_read_delay_s
        self.waiting = 0  # generations queued here now
        self._loads: weakref.WeakKeyDictionary[Endpoint, _Load] = weakref.WeakKeyDictionary()
        self._slot_capacity: dict[str, Capacity] = {}  # last read per slot: what its successor runs
        self._groups: OrderedDict[object, deque[_Waiter]] = OrderedDict()
        self._ticker: asyncio.Task | None = None

    # ------------------------------------------------------------------ client requests

    def check_room(self, generations: int) -> None:
        """Refuse a client request of ``generations`` now, whole, if they could not all wait."""
        if generations > self.max_waiting:
            raise UsageError(f"{generations} generations in one request; at most {self.max_waiting} may wait "
                             "for a worker in this router: split the batch")
        if self.waiting + generations > self.max_waiting:
            raise Overloaded(f"{self.waiting} generations already wait for a worker (at most {self.max_waiting}): "
                             "retry once some are done")

    # ------------------------------------------------------------------ one attempt of a generation

    async def enter(self, tokens: int, group: object, timeout: float) -> Endpoint:
        """An endpoint with room for ``tokens`` (reserved until ``leave``); waits here, in
        ``group``'s turn, while none has room; ``timeout`` bounds the wait for a live worker."""
        await self.table.acquire(timeout)  # a live worker, or WorkerLost / DeviceUnhealthy as before
        await asyncio.gather(*(task for e in self._live() if (task := self._learn(e)) is not None))
        self._refuse_oversized(tokens)
        waiter = _Waiter(tokens, asyncio.get_running_loop().create_future())
        self._groups.setdefault(group, deque()).append(waiter)
        self.waiting += 1
        try:
            self._grant()
            if not waiter.future.done() and (self._ticker is None or self._ticker.done()):
                self._ticker = asyncio.create_task(self._tick(timeout))
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.leave(waiter.future.result(), tokens)  # granted just as the request went away
            raise
        finally:
            queue = self._groups.get(group)
            if queue is not None and waiter in queue:
                queue.remove(waiter)
                self.waiting -= 1
                if not queue:
                    del self._groups[group]

    def leave(self, endpoint: Endpoint, tokens: int) -> None:
        load = self._loads.get(endpoint)
        if load is not None and load.capacity is not None:
            load.sent -= 1
            load.tokens -= load.capacity.cost(tokens)
        self._grant()

    def busy(self, endpoint: Endpoint) -> None:
        """``endpoint`` answered 429: it takes no more than it holds now (this attempt excluded)."""
        load = self._loads.get(endpoint)
        if load is not None and load.capacity is not None:
            load.capacity.inflight = max(1, load.sent - 1)

    # ------------------------------------------------------------------ inside

    def _live(self) -> list[Endpoint]:
        return [e for e in self.table.endpoints() if not e.lost]

    def _learn(self, endpoint: Endpoint) -> asyncio.Task | None:
        """The read of ``endpoint``'s capacity to wait for; None once it is known. A promoted
        shadow is started with its slot's flags: it is sent work at once on what the slot's
        last worker said (its own answer, read ``successor_read_delay_s`` later, replaces that):
        a ``/get_server_info`` round trip through a server just promoted is not on a
        recovery's path, nor beside it."""
        load = self._loads.get(endpoint)
        if load is None:
            load = self._loads[endpoint] = _Load()
            known = self._slot_capacity.get(endpoint.slot)
            if known is not None:
                load.capacity = replace(known)
            delay = self.successor_read_delay_s if known is not None else 0.0
            load.learning = asyncio.create_task(self._read_capacity(endpoint, load, delay))
        return load.learning if load.capacity is None else None

    async def _read_capacity(self, endpoint: Endpoint, load: _Load, delay: float = 0.0) -> None:
        if delay:
            await asyncio.sleep(delay)
        capacity = Capacity()  # a worker that does not say is not limited
        timeout = aiohttp.ClientTimeout(total=self.info_timeout_s)
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            async with self.session.get(endpoint.url + "/get_server_info", timeout=timeout) as resp:
                if resp.status == 200:
                    info = await resp.json(content_type=None)
                    if isinstance(info, dict):
                        capacity = capacity_of(info)
        self._slot_capacity[endpoint.slot] = replace(capacity)
        load.capacity = capacity
        self._grant()

    def _refuse_oversized(self, tokens: int) -> None:
        caps = [load.capacity for e in self._live() if (load := self._loads.get(e)) and load.capacity]
        limits = [c.tokens for c in caps]
        if caps and None not in limits and all(c.cost(tokens) > c.tokens for c in caps):
            shown = tokens if tokens < 10**18 else "over 10**18"
            raise UsageError(f"prompt + max_new_tokens = {shown} tokens, more than any worker's KV holds "
                             f"(at most {max(limits)} tokens)")

    def _room(self, endpoint: Endpoint, tokens: int) -> bool:
        load = self._loads.get(endpoint)
        if load is None or load.capacity is None:
            return False
        cap = load.capacity
        if cap.inflight is not None and load.sent >= cap.inflight:
            return False
        return cap.tokens is None or load.sent == 0 or load.tokens + cap.cost(tokens) <= cap.tokens

    def _grant(self) -> None:
        """Hand endpoints to waiters, one per request in turn, while the one whose turn it is fits."""
        while self._groups:
            group, queue = next(iter(self._groups.items()))
            waiter = queue[0]
            if waiter.future.done():  # failed by the ticker; its enter() forgets it
                return
            fits = [e for e in self._live() if self._room(e, waiter.tokens)]
            if not fits:
                return
            endpoint = min(fits, key=lambda e: (self._loads[e].sent, e.slot))
            load = self._loads[endpoint]
            load.sent += 1
            load.tokens += load.capacity.cost(waiter.tokens)
            queue.popleft()
            self.waiting -= 1
            if queue:
                self._groups.move_to_end(group)
            else:
                del self._groups[group]
            waiter.future.set_result(endpoint)

    async def _tick(self, timeout: float) -> None:
        """While generations wait: read the capacity of endpoints that appeared, grant, and
        fail every waiter once no live worker was there for ``timeout``."""
        loop = asyncio.get_running_loop()
        gone_since: float | None = None
        while self.waiting:
            await asyncio.sleep(_TICK_S)
            live = self._live()
            for e in live:
                self._learn(e)
            if live:
                gone_since = None
            elif gone_since is None:
                gone_since = loop.time()
            elif loop.time() - gone_since >= timeout:
                try:
                    await self.table.acquire(0.0)
                except BelayerError as exc:
                    self._fail_all(exc)
                continue
            self._grant()

    def _fail_all(self, exc: BelayerError) -> None:
        for queue in self._groups.values():
            for waiter in queue:
                if not waiter.future.done():
                    waiter.future.set_exception(exc)
