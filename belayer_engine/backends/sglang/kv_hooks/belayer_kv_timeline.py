"""Where the wait after an adoption goes, in the server's own processes (log lines only).

After an adoption the re-sent requests reach the scheduler tens of ms later on a GPU. Two
places can hold them: the HTTP side (SGLang's HTTP server process: its ASGI app, then the
tokenizer manager, which passes each request to the scheduler) and the scheduler's loop
(which takes requests in only between passes). So the HTTP process logs when the adoption
was answered and when each request reached the app and the tokenizer manager after that
(with wall-clock times, to line up with the router's), the longest stall of its event loop
and any garbage collection over 2 ms in the 300 ms after the answer, and the scheduler how
many loop passes it made before the first request, and the longest gap between two.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time

from belayer_kv_state import ADOPT_TAG, S, say
from belayer_kv_threadstate import ThreadSampler

HEALTH_RID = "HEALTH_CHECK"  # SGLang's /health runs a one-token generate of this rid prefix (not a client's)
LOGGED_REQUESTS = 64  # arrivals logged after an adoption (every in-flight request of a full batch)
LOGGED_FOR_S = 5.0
WATCH_S = 0.3  # the re-sent requests cross the HTTP side within this after the answer
STALL_S = 0.005  # a longer stall is described (what its thread did, from the sampler)


class _Http:
    replied_at: float | None = None  # perf_counter when the adoption's reply was sent
    arrivals = 0
    watch = None  # the loop watch's task (kept: the loop holds only weak references to tasks)
    gc_watched = False


async def _watch_loop(since: float, watch_s: float = WATCH_S, tick_s: float = 0.001) -> None:
    """Whether the HTTP process's event loop stalls after the answer (a blocking call, a
    collection): every re-sent request waits for it. Logs the longest stall and when, and
    what the loop's thread did meanwhile in the kernel's view (``belayer_kv_threadstate``)."""
    sampler = ThreadSampler(threading.get_native_id(), watch_s).start()
    last, longest, began = time.perf_counter(), 0.0, 0.0
    while last - since < watch_s:
        await asyncio.sleep(tick_s)
        now = time.perf_counter()
        if now - last - tick_s > longest:
            longest, began = now - last - tick_s, last - since
        last = now
    offset = sampler.t0 - since
    during = sampler.summary(began - offset, began + longest - offset) if longest > STALL_S else "-"
    say(f"http: the event loop's longest stall in the {1e3 * watch_s:.0f} ms after the answer: "
        f"{1e3 * longest:.1f} ms, from {1e3 * began:.1f} ms; its thread meanwhile: {during}")


def _watch_gc() -> None:
    """Log Python's collections in this process that take over 2 ms in the watch window."""
    if _Http.gc_watched:
        return
    _Http.gc_watched = True
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and _Http.replied_at is not None:
            took, after = time.perf_counter() - started[0], started[0] - _Http.replied_at
            if took > 0.002 and 0 <= after <= WATCH_S:
                say(f"http: a generation-{info.get('generation')} garbage collection took {1e3 * took:.1f} ms, "
                    f"{1e3 * after:.1f} ms after the answer")

    gc.callbacks.append(on_gc)


def patch_tokenizer_manager(module) -> None:
    """Log lines only: an SGLang whose tokenizer manager has other names serves unpatched."""
    cls = getattr(module, "TokenizerManager", None)
    resume, generate = getattr(cls, "resume_memory_occupation", None), getattr(cls, "generate_request", None)
    if resume is None or generate is None:
        say("http timeline off: this SGLang's TokenizerManager has no resume_memory_occupation/generate_request")
        return

    async def resume_memory_occupation(self, obj, *args, **kwargs):
        out = await resume(self, obj, *args, **kwargs)
        if any(isinstance(t, str) and t.startswith(ADOPT_TAG) for t in (getattr(obj, "tags", None) or ())):
            _Http.replied_at, _Http.arrivals = time.perf_counter(), 0
            # wall clock: the router's per-failure times (resent_t, first_token_t) line up with it
            say(f"http: the adoption was answered at wall {time.time():.4f}")
            _watch_gc()
            _Http.watch = asyncio.get_running_loop().create_task(_watch_loop(_Http.replied_at))
        return out

    def generate_request(self, obj, *args, **kwargs):
        if _Http.replied_at is not None and not is_health_check(getattr(obj, "rid", None)):
            after = time.perf_counter() - _Http.replied_at
            _Http.arrivals += 1
            if after <= LOGGED_FOR_S:  # later ones are a later workload's, not the re-sent requests
                say(f"http: request {_Http.arrivals} after the adoption reached the server {1e3 * after:.1f} ms "
                    "after the adoption's reply")
            if _Http.arrivals >= LOGGED_REQUESTS or after > LOGGED_FOR_S:
                _Http.replied_at = None
        return generate(self, obj, *args, **kwargs)

    cls.resume_memory_occupation = resume_memory_occupation
    cls.generate_request = generate_request


def patch_http_server(module) -> None:
    """Log lines only: when each ``/generate`` after an adoption reaches SGLang's ASGI app,
    before FastAPI reads and validates its body (the tokenizer manager's line comes after)."""
    app = getattr(module, "app", None)
    if app is None or not hasattr(app, "add_middleware"):
        say("http timeline off: this SGLang's http_server has no app")
        return

    class _Arrival:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if _Http.replied_at is not None and scope.get("type") == "http" and scope.get("path") == "/generate":
                after = time.perf_counter() - _Http.replied_at
                if after <= LOGGED_FOR_S:
                    say(f"http: a /generate reached SGLang's app {1e3 * after:.1f} ms after the adoption's reply "
                        f"(wall {time.time():.4f})")
            await self.inner(scope, receive, send)

    app.add_middleware(_Arrival)


def is_health_check(rid) -> bool:
    return isinstance(rid, str) and rid.startswith(HEALTH_RID)


def note_scheduler_pass() -> None:
    """One pass of the scheduler's loop (it takes in requests at each), counted between the
    adoption and the first request after it."""
    if S.adopted_at is None or S.first_arrival is not None:
        return
    now = time.perf_counter()
    S.loop_passes += 1
    S.loop_gap = max(S.loop_gap, now - (S.loop_last or S.adopted_at))
    S.loop_last = now


def log_first_arrival() -> None:
    """Once per adoption, as its first request reaches the scheduler."""
    say(f"scheduler: the first request after the adoption came after {S.loop_passes} loop passes, the "
        f"longest {1e3 * S.loop_gap:.1f} ms apart")
