"""The critical path of one kill, segment by segment (``engine_handover.py``'s ``breakdown``).

The engine, hence its router, runs in the benchmark's process: ``instrument_router`` wraps
the router's upstream call, so every ``/generate`` it sends is timed (sent, first token)
on the same monotonic clock as the supervisor's events.
"""

from __future__ import annotations

import time
from contextlib import aclosing

SENDS: list[dict] = []  # every /generate the router sent: monotonic send / first-token times


def instrument_router() -> None:
    """Time the router's upstream calls (into ``SENDS``)."""
    from belayer_engine.router import recovery

    inner = recovery.stream_generate

    async def timed(session, endpoint, body, **kw):
        rec = {"t_sent": time.monotonic(), "rid": body.get("rid"), "input_len": len(body.get("input_ids", []))}
        SENDS.append(rec)
        async with aclosing(inner(session, endpoint, body, **kw)) as chunks:
            async for chunk in chunks:
                if "t_first" not in rec and chunk.ids:
                    rec["t_first"] = time.monotonic()
                    rec["worker_e2e_s"] = chunk.meta.get("e2e_latency")
                yield chunk

    recovery.stream_generate = timed


def breakdown(events: list[dict], t_kill: float, t_client: float) -> dict:
    """Critical-path segments of one kill: detect, fence, health, activate, route, then the
    re-sent request's resend, first_chunk and deliver (see ``engine_handover.py``)."""
    def first(kind: str) -> dict | None:
        return next((e for e in events if e["event"] == kind and e["t"] >= t_kill), None)

    marks = [("detect", first("detected")), ("fence", first("fenced")), ("health", first("arena_checked")),
             ("activate", first("activated")), ("route", first("routed"))]
    send = next((r for r in SENDS if r["t_sent"] >= t_kill), None)
    out, prev = {}, t_kill
    for name, ev in marks:
        if ev is None:
            out[f"{name}_s"] = None
            continue
        out[f"{name}_s"], prev = ev["t"] - prev, ev["t"]
    if send is not None:
        out["resend_s"] = send["t_sent"] - prev
        out["first_chunk_s"] = send.get("t_first", t_client) - send["t_sent"]
        out["deliver_s"] = t_client - send.get("t_first", t_client)
        out["reprefill_s"] = send.get("worker_e2e_s")
        out["reprefill_tokens"] = send["input_len"]
    health, act = first("arena_checked"), first("activated")
    out["health_took_s"] = (health or {}).get("took_s")
    out["worker_activate_s"] = (act or {}).get("activate_s")
    out["activate_post_s"] = (act or {}).get("post_s")
    return out
