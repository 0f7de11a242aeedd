"""Worker-level hardening against real processes (issue 12).

- A request that fails the replacement worker too (no token there) is ended with a clear
  error instead of being replayed again, and its slot is handed over, not excluded.
- Another local user (``nobody``) cannot generate on or abort a worker: every worker
  endpoint needs the engine's per-engine secret, which never appears in argv.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from belayer_core.errors import RequestFailed
from belayer_engine import RecoverableEngine
from belayer_engine.router import RouterConfig

from .conftest import poll
from .test_router_hardening import (
    AUTH,
    _send_and_leave,
    assert_healthy,
    call,
    chat,
    router,
    worker_load,
    worker_url,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def engine():
    cfg = RouterConfig(api_key=AUTH["Authorization"][7:], stall_timeout_s=1.0, stall_probe_timeout_s=1.0)
    with RecoverableEngine.launch(workers=1, shadow=True, router=cfg) as eng:
        eng.wait_ready(timeout=180)
        yield eng


async def _first_chunk_then(engine, body: dict, between) -> list[dict]:
    """Stream ``body``; after the first content chunk run ``between()`` (in a thread); all events."""
    events, ran = [], False
    async with aiohttp.ClientSession(headers=AUTH) as s, s.post(engine.base_url + "/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if not ran and events[-1].get("choices") and events[-1]["choices"][0].get("delta", {}).get("content"):
                ran = True
                await asyncio.to_thread(between)
    return events


def test_a_request_that_fails_the_replacement_too_is_ended_and_the_slot_kept(engine):
    since = len(engine.events())
    t0 = time.monotonic()
    first_pid = engine.worker_pid()
    body = {"model": "m", "messages": [{"role": "user", "content": "rope " * 300}], "max_tokens": 40,
            "temperature": 0, "ignore_eos": True, "stream": True}

    def kill_worker_then_stop_its_replacement():
        os.kill(first_pid, signal.SIGKILL)
        routed = engine.wait_event("routed", t0, timeout=120)
        os.kill(routed["pid"], signal.SIGSTOP)  # stuck in the replay's prefill: no token there

    events = asyncio.run(_first_chunk_then(engine, body, kill_worker_then_stop_its_replacement))
    error = events[-1].get("error")
    assert error and error["code"] == 500 and "not replayed again" in error["message"], events[-1]
    engine.wait_event("handover", engine.wait_event("not_excluded", t0)["t"], timeout=180)
    engine.wait_ready(timeout=180)
    kinds = [e["event"] for e in engine.events()[since:]]
    assert "excluded" not in kinds and kinds.count("handover") == 2, kinds
    status, out = chat(engine)
    assert status == 200 and out["belayer"]["recoveries"] == 0
    assert_healthy(engine, len(engine.events()))


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    runner = shutil.which("setpriv")
    if os.geteuid() != 0 or runner is None:
        pytest.skip("needs root and setpriv to act as another local user")
    return subprocess.run([runner, "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=60, cwd="/")


NOBODY_CLIENT = r"""
import json, sys, urllib.request, urllib.error
url, path, body = sys.argv[1], sys.argv[2], sys.argv[3]
req = urllib.request.Request(url + path, data=body.encode() or None, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=30) as r:
        print(r.status, r.read().decode()[:200])
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode()[:200])
for pid in sys.argv[4:]:
    try:
        open(f"/proc/{pid}/environ", "rb").read()
        print("environ readable", pid)
    except OSError as e:
        print("environ closed", pid, e.errno)
"""


def test_another_local_user_cannot_use_or_abort_a_worker(engine):
    since = len(engine.events())
    url = worker_url(engine)
    pids = [str(engine.worker_pid()), str(engine.status()["slots"]["w0"]["shadow_pid"])]
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3")
    for path, body in [("/generate", '{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}'),
                       ("/abort_request", '{"abort_all": true}'), ("/abort_request", '{"abort_all": true}'),
                       ("/health", ""), ("/belayer/state", "")]:
        out = _as_nobody(python, "-c", NOBODY_CLIENT, url, path, body, *pids)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("401 "), (path, out.stdout)
        assert lines[1:] == [f"environ closed {p} 13" for p in pids], out.stdout  # EACCES: the secret stays hidden
    secret = engine.worker_headers()["Authorization"][7:].encode()
    for pid in pids:  # and it is not on any command line
        assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
    status, out, _ = call(url, "GET", "/health")
    assert status == 401
    status, out, _ = call(url, "GET", "/health", headers=engine.worker_headers())
    assert status == 200
    status, out = chat(engine)
    assert status == 200 and out["belayer"]["recoveries"] == 0
    assert_healthy(engine, since)
    assert call(router(engine), "GET", "/health")[0] == 200


def _chat_in_thread(engine, body: dict) -> tuple[threading.Thread, dict]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=call(router(engine), "POST", "/v1/chat/completions", body, headers=AUTH)))
    t.start()
    return t, box


def test_aborts_on_a_healthy_worker_end_those_requests_only(engine):
    """Issue 12, item 2, as the engine itself: two abort_all 1.5 s apart end the running
    requests with a clear error; the worker is healthy, so no handover, no exclusion."""
    since = len(engine.events())
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    first, box1 = _chat_in_thread(engine, body)
    poll(lambda: worker_load(engine)["running"] == 1, 60, "the request to run")
    status, out, _ = call(worker_url(engine), "POST", "/abort_request", {"abort_all": True}, headers=engine.worker_headers())
    assert status == 200, out
    first.join(timeout=60)
    second, box2 = _chat_in_thread(engine, body)
    poll(lambda: worker_load(engine)["running"] == 1, 60, "the second request to run")
    call(worker_url(engine), "POST", "/abort_request", {"abort_all": True}, headers=engine.worker_headers())
    second.join(timeout=60)
    for box in (box1, box2):
        status, out, _ = box["out"]
        assert status == 500 and "RequestFailed" in out["error"]["message"], out
    assert_healthy(engine, since)
    assert chat(engine)[0] == 200


def test_a_silent_request_on_a_healthy_worker_is_ended_alone(engine):
    """A request queued behind full KV gets no token for ``max_silence_s`` (3 s, in a second
    router in front of the same worker): it is ended with a clear error, and the healthy
    worker is neither reported nor fenced as stalled."""
    from belayer_engine.client import EngineClient
    from belayer_engine.router import Router

    since = len(engine.events())
    long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    socks = [_send_and_leave(router(engine), long) for _ in range(2)]  # 192 of 256 blocks

    async def queued_request():
        secret = engine.worker_headers()["Authorization"][7:]
        r = Router(RouterConfig(stall_timeout_s=0.5, stall_probe_timeout_s=5.0, max_silence_s=3.0, worker_api_key=secret))
        r.add_static_workers([worker_url(engine)])
        base = await r.start()
        try:
            await r.table.acquire(60)
            async with EngineClient(base + "/v1") as c:
                with pytest.raises(RequestFailed, match="while the worker stays healthy"):
                    await c.chat([{"role": "user", "content": "x"}], max_tokens=1500, ignore_eos=True)
            return [e for e in r.table.endpoints() if not e.lost]
        finally:
            await r.stop()

    try:
        poll(lambda: worker_load(engine)["running"] == 2, 60, "2 long requests to run")
        assert len(asyncio.run(queued_request())) == 1  # the worker was never reported
    finally:
        for s in socks:
            s.close()
    assert_healthy(engine, since)
