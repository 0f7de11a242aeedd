"""What the engine's kill benchmarks share: the prompt, one greedy stream with a SIGKILL of
the serving worker at a given token, the engine's backend options, summaries, the result's
file tag.

``engine_handover.py`` (how long a client waits) and ``engine_regeneration.py`` (how many
tokens are generated twice) both stream through ``RecoverableEngine`` in this process.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path

from belayer_engine.client import EngineClient

PROMPT = "The belay device holds the rope when"


async def stream_with_kill(base_url: str, max_tokens: int, kill_at: int, pid: int) -> dict:
    """One greedy stream of ``max_tokens``; SIGKILL ``pid`` once ``kill_at`` tokens arrived.
    The arrival time of every token, the ids, the kill's time and the ``belayer`` record."""
    arrivals: list[float] = []
    ids: list[int] = []
    t_kill = None
    summary: dict = {}
    async with EngineClient(base_url) as client:
        async for chunk in client.stream_complete(PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True):
            for choice in chunk["choices"]:
                now = time.monotonic()
                ids += choice.get("token_ids", [])
                arrivals += [now] * len(choice.get("token_ids", []))
                if t_kill is None and len(arrivals) >= kill_at:
                    t_kill = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                if choice.get("finish_reason"):
                    summary = chunk.get("belayer", {})
    return {"arrivals": arrivals, "ids": ids, "t_kill": t_kill, "summary": summary}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The options both benchmarks launch the engine with."""
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", choices=["reference", "sglang"], default="reference")
    p.add_argument("--sglang-shadow-memory-saver", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--sglang-venv", default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--arena-arg", action="append", default=[], help="extra arena option (repeatable)")
    p.add_argument("--sglang-shadow-release-graphs", action="store_true",
                   help="the SGLang shadow also releases its decode CUDA graphs while idle")
    p.add_argument("--sglang-cuda-stack-bytes", type=int, default=None,
                   help="each SGLang server's CUDA per-thread stack limit (default 256; 0: the driver's 1 KiB)")
    p.add_argument("--tag", default="", help="suffix of the result file names")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--plot-only", default=None, help="re-draw the plot of an existing result JSON")


def backend_kwargs(args: argparse.Namespace) -> dict:
    """``RecoverableEngine.launch`` options of ``--backend``."""
    if args.backend != "sglang":
        return {}
    saver = {"auto": None, "on": True, "off": False}[args.sglang_shadow_memory_saver]
    return {"backend": "sglang", "sglang_venv": args.sglang_venv, "sglang_shadow_memory_saver": saver,
            "sglang_shadow_release_graphs": args.sglang_shadow_release_graphs or None,
            "sglang_cuda_stack_bytes": args.sglang_cuda_stack_bytes}


def result_tag(args: argparse.Namespace) -> str:
    """``cpu``, ``cuda0``, ``cuda0_sglang``, ... then ``--tag``: the result file's suffix."""
    return args.device.replace(":", "") + ("_sglang" if args.backend == "sglang" else "") + args.tag


def stats(xs: list[float | None]) -> dict:
    """Mean, median, min, max and count of the values that are not None ({} for none)."""
    xs = [x for x in xs if x is not None]
    return ({"mean": statistics.fmean(xs), "p50": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
            if xs else {})
