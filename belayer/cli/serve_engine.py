"""``belayer serve engine``: router + supervisor (+ arena, workers, shadows) in the foreground.

``belayer serve router --worker URL ...`` fronts existing SGLang-protocol workers (for
example real SGLang servers) with token-level continuation but no supervisor.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import signal
import threading

from belayer_core.config_flags import ConfigFlags

ENGINE_HELP = "OpenAI-compatible recoverable engine: router + supervisor + arena/workers/shadows"
ROUTER_HELP = "router only, in front of existing SGLang-protocol workers (no supervisor)"

# Rows for ``belayer.cli.serve.TARGETS`` (flags, runner, help):
TARGET_ROWS = {
    "engine": ("belayer.cli.serve_engine:engine_flags", "belayer.cli.serve_engine:run_engine", ENGINE_HELP),
    "router": ("belayer.cli.serve_engine:router_flags", "belayer.cli.serve_engine:run_router", ROUTER_HELP),
}


@functools.cache
def _router_flags(exclude: tuple[str, ...] = ()) -> ConfigFlags:
    from belayer_engine.router import RouterConfig

    # a server's usual port; the config's own default (0: any free port) suits embedding.
    # No flag takes the workers' key itself (argv is visible in ps): --worker-api-key-file.
    return ConfigFlags(RouterConfig, exclude=("worker_api_key", *exclude), defaults={"port": 8000},
                       title="router (RouterConfig)")


@functools.cache
def _supervisor_flags() -> ConfigFlags:
    from belayer_engine.supervisor.config import SupervisorConfig

    # workers bind to loopback and run under this interpreter: not a user's choice here
    return ConfigFlags(SupervisorConfig, exclude=("host", "python"), title="supervisor (SupervisorConfig)")


def engine_flags(p: argparse.ArgumentParser) -> None:
    _router_flags(("tokenizer",)).add_to(p)  # the router tokenizes with --model's tokenizer
    _supervisor_flags().add_to(p)
    p.add_argument("--json", action="store_true", help="print the endpoint as JSON once ready")


def router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", action="append", required=True, help="worker base URL (repeatable)")
    _router_flags().add_to(p)
    p.add_argument("--json", action="store_true", help="print the endpoint as JSON once ready")


def _announce(args, url: str, weights_socket: str | None = None) -> None:
    """The ready line; an engine also names its weight endpoint (learners in other processes)."""
    if args.json:
        extra = {"weights_socket": weights_socket} if weights_socket else {}
        print(json.dumps({"base_url": url + "/v1", **extra}), flush=True)
        return
    weights = f"; weights: {weights_socket}" if weights_socket else ""
    print(f"serving on {url}/v1{weights} (Ctrl-C to stop)", flush=True)


def _on_stop_signal() -> asyncio.Event:
    """An event set by SIGINT/SIGTERM. Install it *before* announcing readiness: a caller
    may send SIGTERM as soon as it reads the endpoint, and without the handler that signal
    kills the process outright (no graceful stop; the supervisor's children, in their own
    sessions, would be left running)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run_engine(args) -> int:
    from belayer_engine.engine import RecoverableEngine

    sup_cfg = _supervisor_flags().build(args)
    router_cfg = _router_flags(("tokenizer",)).build(args, tokenizer=sup_cfg.model)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before announcing readiness: see _on_stop_signal
        signal.signal(sig, lambda *_: stop.set())
    engine = RecoverableEngine(sup_cfg, router_cfg)  # the engine is wired there, once
    try:
        engine.start()
        _announce(args, engine.base_url.removesuffix("/v1"), weights_socket=engine.weights_socket)
        while not stop.wait(0.5):
            pass
    finally:
        engine.stop()
    return 0


def run_router(args) -> int:
    from belayer_engine.router import Router

    router_cfg = _router_flags().build(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        router = Router(router_cfg)
        router.add_static_workers(args.worker)
        url = await router.start()
        try:
            stop = _on_stop_signal()
            _announce(args, url)
            await stop.wait()
        finally:
            await router.stop()

    asyncio.run(main())
    return 0
