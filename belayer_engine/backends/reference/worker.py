"""Reference inference worker: SGLang's native HTTP protocol over :class:`WorkerState`.

``python -m belayer_engine.backends.reference.worker --arena-socket PATH [--host 127.0.0.1] --port N
[--shadow] [--worker-id ID]`` (also ``belayer serve worker``). Routes and fields are
documented in docs/engine.md; the contract with the router is docs/contracts.md.

This module is the process (flags, the owner watch, serving until SIGINT, the drain); its
routes are ``routes.WorkerApp``, the ``/generate`` body and answer ``sglang_generate.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import NoReturn

from aiohttp import web

from belayer_engine.backends.reference.config import FLAGS, WorkerConfig, add_flags
from belayer_engine.backends.reference.routes import WorkerApp
from belayer_engine.backends.reference.state import WorkerState
from belayer_engine.common import owner, worker_auth

__all__ = ["DRAIN_S", "WorkerApp", "main", "run"]


DRAIN_S = 5.0  # a SIGINT'ed worker finishes its running requests for at most this long
_CUT_S = 0.5  # then aiohttp gets this long to cancel what still runs and close the connections


def run(args: argparse.Namespace) -> NoReturn:
    cfg = FLAGS.build(args)
    owner.watch_owner(lambda: os._exit(1), death_signal=signal.SIGKILL)  # never outlive the engine
    secret = worker_auth.take_from_env()
    if secret is None:
        print(f"warning: {worker_auth.ENV} not set: every local user can use this worker", file=sys.stderr)
    rt = WorkerState(cfg.arena_socket, cfg.worker_id, cfg.shadow, cfg.threads,
                       cfg.max_running, cfg.max_prefill_tokens, tokenizer_dir=cfg.tokenizer_dir)
    code = asyncio.run(_serve(WorkerApp(rt, secret, cfg.hang_timeout_s, cfg.max_queued), cfg))
    # Listener, connections, engine thread and arena attachment are closed: leave without the
    # interpreter's teardown (torch's takes seconds on a loaded machine, and a thread still
    # inside torch can abort it), so the supervisor sees this clean exit promptly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve(worker: WorkerApp, cfg: WorkerConfig) -> int:
    """Serve until SIGINT, then drain: close the listener, let running requests finish for
    at most DRAIN_S, cut the rest (the router continues them on the shadow token by token),
    stop the engine thread and return 0.

    SIGINT is the loop's own handler, not asyncio.run's: (1) asyncio.run installs none when
    SIGINT was inherited ignored, as by every child of an engine started as a background job
    of a shell script; such a worker ignored SIGINT and kept serving, so nothing replaced it.
    (2) asyncio.run's handler cancels this task, and aiohttp's graceful shutdown inside a
    cancelled task re-raises at its first timeout: the runner was left half torn down and
    the engine thread inside torch while the interpreter exited ("terminate called without
    an active exception", exit -6). The loop's handler also wakes the loop through its
    wakeup fd, whichever thread the kernel delivered the signal to.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, stop.set)  # before "ready": a caller may signal at once
    # handler_cancellation: a client gone away aborts its request, streamed or not.
    runner = web.AppRunner(worker.app, access_log=None, handler_cancellation=True, shutdown_timeout=_CUT_S)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    print(json.dumps({"event": "ready", "port": port, "pid": os.getpid(),
                      "state": worker.rt.state, "init_s": worker.rt.init_s}), flush=True)
    try:
        await stop.wait()
        t0 = time.monotonic()
        await site.stop()  # refuse new connections (the supervisor's probes fail from here on)
        print(json.dumps({"event": "draining", "running": len(worker.live)}), flush=True)
        drained = await worker.drain(DRAIN_S)
        print(json.dumps({"event": "drained" if drained else "drain_cut", "cut": len(worker.live),
                          "drain_s": round(time.monotonic() - t0, 3)}), flush=True)
    finally:
        await runner.cleanup()  # cancels what still runs: its stream breaks, it is not finished
        worker.rt.close()
    print(json.dumps({"event": "exit", "code": 0}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m belayer_engine.backends.reference.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    try:
        return run(p.parse_args(argv))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
