"""SIGKILL a worker mid-stream; measure how long the client waits for the next token.

Compares (a) a cold restart of the worker (no shadow) with (b) a shadow handover, side by
side on the same machine, and with ``--modes cold-disk`` (c) a plain SGLang server restarted
from disk, the baseline without Belayer (``_sglang_cold_disk.py``). Writes JSON and a plot
(the wait; the memory of a serving worker next to its idle shadow) to ``benchmarks/results/``.
How many tokens are generated twice (token-level vs every-k): ``engine_regeneration.py``.

    python benchmarks/engine_handover.py                 # CPU, embedded small model
    python benchmarks/engine_handover.py --device cuda:0 --arena-arg=--preset --arena-arg=qwen3-4b
    python benchmarks/engine_handover.py --device cuda:0 --model-dir DIR --repeats 4
    python benchmarks/engine_handover.py --backend sglang --repeats 2   # real SGLang servers

Kill-to-first-token is measured from the ``kill()`` call to the arrival at the client of
the first token produced by the replacement worker (the token at the failure index);
detection latency from ``kill()`` to the supervisor's ``detected`` event (same clock:
the engine runs in this process). Each run is broken down along the critical path
(``breakdown``): detect (kill -> ``detected``), fence (-> ``fenced``: SIGKILL of the group,
reaped), health (-> ``arena_checked``; ``health_took_s`` is the check itself, which runs
during the fence), activate (-> ``activated``; cold: the worker's cold start), route
(-> ``routed``), resend (-> the router's new ``/generate``), first_chunk (-> its first token
at the router; ``reprefill_s`` is the worker's own request-to-first-token time, i.e. the
re-prefill of prompt + generated), deliver (-> the client has it); ``_handover_breakdown.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import _procmem as procmem  # benchmarks/, on sys.path when run as a script
from _handover_breakdown import breakdown, instrument_router
from _handover_common import (
    PROMPT,
    add_engine_args,
    backend_kwargs,
    result_tag,
    stats,
    stream_with_kill,
)
from _sglang_cold_disk import measure_cold_disk

from belayer_engine.client import EngineClient
from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig


def _first_mismatch(got: list[int], want: list[int]) -> int | None:
    """Index of the first id that differs from the fault-free run (None: identical)."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


async def _throughput(base_url: str, batch: int, max_tokens: int) -> dict:
    """``batch`` greedy streams at once through the engine: generated tokens per second."""
    async def one(client: EngineClient, i: int) -> int:
        n = 0
        async for chunk in client.stream_complete(f"{PROMPT} ({i})", max_tokens=max_tokens, temperature=0,
                                                  ignore_eos=True):
            n += sum(len(c.get("token_ids", [])) for c in chunk["choices"])
        return n

    async with EngineClient(base_url) as client:
        t0 = time.monotonic()
        counts = await asyncio.gather(*(one(client, i) for i in range(batch)))
        wall = time.monotonic() - t0
    return {"batch": batch, "max_tokens": max_tokens, "tokens": sum(counts), "wall_s": wall,
            "tokens_per_s": sum(counts) / wall}


def measure(mode: str, args, rng: random.Random) -> tuple[list[dict], dict]:
    shadow = mode == "shadow"
    # an SGLang cold start is ~1-2 min on 2 loaded cores
    router = RouterConfig(recovery=args.recovery, request_wait_s=900)
    runs, extra = [], {}
    with RecoverableEngine.launch(workers=1, shadow=shadow, device=args.device, model=args.model_dir,
                                  router=router, unhealthy_window_s=0.0, arena_args=args.arena_arg,
                                  worker_args=args.worker_arg, start_timeout_s=900, **backend_kwargs(args)) as eng:
        eng.wait_ready(timeout=900)
        asyncio.run(stream_with_kill(eng.base_url, 8, 10**9, 0))  # warm-up (nothing killed)
        reference = asyncio.run(stream_with_kill(eng.base_url, args.max_tokens, 10**9, 0))["ids"] if args.identity else None
        for _ in range(args.repeats):
            eng.wait_ready(timeout=600, stable=True)
            pid = eng.worker_pid(0)
            kill_at = rng.randint(args.max_tokens // 4, args.max_tokens // 2)
            r = asyncio.run(stream_with_kill(eng.base_url, args.max_tokens, kill_at, pid))
            failure = r["summary"]["failures"][0]
            first_new = r["arrivals"][failure["at_token"]]
            detected = [e["t"] for e in eng.events() if e["event"] == "detected" and e["t"] >= r["t_kill"]]
            handover = [e for e in eng.events() if e["event"] == "handover" and e["t"] >= r["t_kill"]]
            routed = [e["t"] for e in eng.events() if e["event"] == "routed" and e["t"] >= r["t_kill"]]
            runs.append({
                "kill_at_client_token": kill_at,
                "failure_at_token": failure["at_token"],
                "kill_to_first_token_s": first_new - r["t_kill"],
                "detection_s": (detected[0] - r["t_kill"]) if detected else None,
                "handover_path": handover[0]["path"] if handover else None,
                "supervisor_handover_s": handover[0]["total_s"] if handover else None,
                "routed_to_first_token_s": (first_new - routed[0]) if routed else None,
                "breakdown": breakdown(eng.events(), r["t_kill"], first_new),
                "reprefilled_tokens": r["summary"].get("reprefilled_tokens"),
                "replayed_tokens": r["summary"].get("replayed_tokens"),
            })
            if reference is not None:  # the same greedy request without a fault
                runs[-1]["first_mismatch"] = _first_mismatch(r["ids"], reference)
                runs[-1]["identical"] = runs[-1]["first_mismatch"] is None
            print(mode, json.dumps(runs[-1]), flush=True)
        if shadow:
            eng.wait_ready(timeout=900)
            slot = eng.status()["slots"]["w0"]
            starts = [e["start_s"] for e in eng.events() if e["event"] == "shadow_ready"]
            extra = {"shadow_init_s": starts,
                     "memory": _memory(slot["worker_pid"], slot["shadow_pid"], slot.get("arena_pid"))}
            if args.throughput:
                extra["throughput"] = [asyncio.run(_throughput(eng.base_url, b, args.throughput_tokens))
                                       for b in args.throughput]
                print("throughput", json.dumps(extra["throughput"]), flush=True)
    return runs, extra


def _tree_mib(pid: int) -> dict:
    """RSS / PSS / private MiB summed over a process and its children."""
    return procmem.tree_mib(pid, ("rss", "pss", "private"))[1]


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _model_shape(model_dir: str | None) -> dict | None:
    """Layers, hidden size and vocabulary of the measured model (config.json); None for the
    embedded default, which the result then names by ``model_dir: null``."""
    if model_dir is None:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return {k: cfg.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size", "torch_dtype")}


def _memory(worker_pid: int, shadow_pid: int, arena_pid: int | None = None) -> dict:
    gpu = procmem.gpu_mib()
    out = {"worker_rss_mib": _rss_mib(worker_pid), "shadow_rss_mib": _rss_mib(shadow_pid),
           "worker_gpu_mib": procmem.tree_gpu_mib(gpu, worker_pid), "shadow_gpu_mib": procmem.tree_gpu_mib(gpu, shadow_pid),
           "worker_tree_mib": _tree_mib(worker_pid), "shadow_tree_mib": _tree_mib(shadow_pid)}
    if arena_pid is not None:
        out["arena_gpu_mib"] = procmem.tree_gpu_mib(gpu, arena_pid)
        parts = [out[k] for k in ("arena_gpu_mib", "worker_gpu_mib", "shadow_gpu_mib")]
        out["engine_gpu_mib"] = sum(parts) if all(v is not None for v in parts) else None
    return out


def plot(result: dict, path: Path) -> None:
    from _plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = {"cold-disk": "restart from disk\n(no Belayer)", "cold": "cold restart\n(arena weights)",
             "shadow": "shadow handover"}
    modes = [m for m in names if result["summary"].get(m, {}).get("kill_to_first_token_s")]
    labels = [names[m] for m in modes]
    means = [result["summary"][m]["kill_to_first_token_s"]["mean"] for m in modes]
    det = [result["summary"][m]["detection_s"].get("mean", 0.0) for m in modes]
    colors = {"cold-disk": "#822", "cold": "#c44", "shadow": "#4a4"}
    a.bar(labels, means, color=[colors[m] for m in modes], label="kill -> first continued token")
    a.bar(labels, det, color="#333", width=0.3, label="detection")
    a.set_yscale("log")
    a.set_ylabel("seconds (log)")
    ratios = [f"{result['summary'][k]:.0f}x vs {w}" for k, w in (("speedup_vs_cold_disk", "disk"), ("speedup", "cold"))
              if k in result["summary"]]
    a.set_title(f"SIGKILL mid-stream ({result['device']}): " + ", ".join(ratios), fontsize=9)
    a.legend()
    _memory_panel(b, result)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _memory_panel(ax, result: dict) -> None:
    """The serving worker's own memory next to its idle shadow's: GPU where measured, else RSS."""
    mem = (result.get("shadow") or {}).get("memory") or {}
    server = "SGLang server" if result.get("backend") == "sglang" else "worker process"
    if mem.get("shadow_gpu_mib"):
        kind, ylabel, title = "gpu", "own GPU memory, MiB (weights in the arena)", f"GPU memory per {server}"
    elif mem.get("shadow_rss_mib"):
        kind, ylabel, title = "rss", "RSS, MiB (the arena's weights mapped, shared)", f"memory per {server}"
    else:
        ax.set_axis_off()
        return
    ax.bar(["serving worker", "shadow (idle)"], [mem[f"worker_{kind}_mib"], mem[f"shadow_{kind}_mib"]],
           color=["#48c", "#4a4"])
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    p.add_argument("--modes", default="cold,shadow", help="which of cold,shadow,cold-disk to run (split a long GPU "
                   "run); cold-disk: a plain SGLang server restarted from disk, the no-Belayer baseline")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra worker option, e.g. --worker-arg=--enable-deterministic-inference (repeatable)")
    p.add_argument("--recovery", choices=["token", "replay"], default="token",
                   help="how a killed stream continues: re-prefill (token) or forced decode (replay; sglang)")
    p.add_argument("--identity", action="store_true",
                   help="compare every continued response with the same request's fault-free greedy ids")
    p.add_argument("--throughput", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="after the kills: greedy streams at once through the engine, e.g. 1,16")
    p.add_argument("--throughput-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return
    if args.model_dir is None and args.device != "cpu":
        print("engine_handover: no --model-dir: the embedded model (a few layers, not a Qwen3 shape) is measured",
              file=sys.stderr, flush=True)
    instrument_router()
    rng = random.Random(7)
    result = {"device": args.device, "backend": args.backend, "host": platform.node(), "cpus": os.cpu_count(),
              "worker_args": args.worker_arg, "recovery": args.recovery, "model_dir": args.model_dir,
              "model": _model_shape(args.model_dir), "sglang_cuda_stack_bytes": args.sglang_cuda_stack_bytes, "runs": {}}
    for mode in args.modes.split(","):
        if mode == "cold-disk":
            if args.backend != "sglang":
                p.error("--modes cold-disk is the SGLang baseline (--backend sglang)")
            Path(args.out).mkdir(parents=True, exist_ok=True)
            result["runs"][mode] = measure_cold_disk(args, rng)
            continue
        result["runs"][mode], extra = measure(mode, args, rng)
        result.update({"shadow": extra} if extra else {})
    modes = list(result["runs"])
    summary = {m: {k: stats([r[k] for r in result["runs"][m]]) for k in ("kill_to_first_token_s", "detection_s", "supervisor_handover_s", "routed_to_first_token_s")}
               for m in modes}
    for m in modes:
        keys = dict.fromkeys(k for r in result["runs"][m] for k, v in r["breakdown"].items() if isinstance(v, float))
        summary[m]["breakdown_mean"] = {k: stats([r["breakdown"].get(k) for r in result["runs"][m]]).get("mean") for k in keys}
    if {"cold", "shadow"} <= set(modes):
        summary["speedup"] = summary["cold"]["kill_to_first_token_s"]["mean"] / summary["shadow"]["kill_to_first_token_s"]["mean"]
    if {"cold-disk", "shadow"} <= set(modes):
        summary["speedup_vs_cold_disk"] = (summary["cold-disk"]["kill_to_first_token_s"]["mean"]
                                           / summary["shadow"]["kill_to_first_token_s"]["mean"])
    result["summary"] = summary
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = result_tag(args)
    (out / f"engine_handover_{tag}.json").write_text(json.dumps(result, indent=2))
    try:
        if "speedup" in summary or "speedup_vs_cold_disk" in summary:
            plot(result, out / f"engine_handover_{tag}.png")
    except ImportError as exc:  # e.g. no matplotlib on the GPU machine: use --plot-only later
        print(f"no plot: {exc}")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
