"""``belayer serve engine``: router + supervisor (+ arena, workers, shadows) in the foreground.

``belayer serve router --worker URL ...`` fronts existing SGLang-protocol workers (for
example real SGLang servers) with token-level continuation but no supervisor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import threading

ENGINE_HELP = "OpenAI-compatible recoverable engine: router + supervisor + arena/workers/shadows"
ROUTER_HELP = "router only, in front of existing SGLang-protocol workers (no supervisor)"

# Rows for ``belayer.cli.serve.TARGETS`` (flags, runner, help):
TARGET_ROWS = {
    "engine": ("belayer.cli.serve_engine:engine_flags", "belayer.cli.serve_engine:run_engine", ENGINE_HELP),
    "router": ("belayer.cli.serve_engine:router_flags", "belayer.cli.serve_engine:run_router", ROUTER_HELP),
}


def engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF-layout model dir (default: embedded small model)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--no-shadow", dest="shadow", action="store_false", help="no shadow workers (cold restart only)")
    p.add_argument("--device", default="cpu", help="cpu, cuda (one slot per GPU) or cuda:N")
    _router_options(p)
    p.add_argument("--unhealthy-window", type=float, default=10.0, help="seconds; a replacement failing within = bad device")
    p.add_argument("--run-dir", default=None, help="logs and sockets (default: a temporary directory)")
    p.add_argument("--arena-arg", action="append", default=[], help="extra arena option, e.g. --arena-arg=--preset")


def router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", action="append", required=True, help="worker base URL (repeatable)")
    p.add_argument("--tokenizer", default=None, help="model dir with tokenizer.json (default: byte tokenizer)")
    _router_options(p)


def _router_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--recovery", choices=["token", "chunk"], default="token")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--stall-timeout", type=float, default=10.0)
    p.add_argument("--json", action="store_true", help="print the endpoint as JSON once ready")


def _router_config(args, tokenizer=None):
    from belayer_engine.router import RouterConfig

    return RouterConfig(host=args.host, port=args.port, api_key=args.api_key, recovery=args.recovery,
                        chunk_tokens=args.chunk_tokens, stall_timeout_s=args.stall_timeout, tokenizer=tokenizer)


def _announce(args, url: str) -> None:
    print(json.dumps({"base_url": url + "/v1"}) if args.json else f"serving on {url}/v1 (Ctrl-C to stop)", flush=True)


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
    from belayer_engine.supervisor import SupervisorConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sup_cfg = SupervisorConfig(model=args.model, workers=args.workers, shadow=args.shadow, device=args.device,
                               unhealthy_window_s=args.unhealthy_window, run_dir=args.run_dir,
                               arena_args=args.arena_arg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before announcing: see _on_stop_signal
        signal.signal(sig, lambda *_: stop.set())
    engine = RecoverableEngine(sup_cfg, _router_config(args, args.model))
    try:
        engine.start()
        _announce(args, engine.base_url.removesuffix("/v1"))
        while not stop.wait(0.5):
            pass
    finally:
        engine.stop()
    return 0


def run_router(args) -> int:
    from belayer_engine.router import Router

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        router = Router(_router_config(args, args.tokenizer))
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
