"""Kill one rank of a tensor-parallel SGLang server: how long each client waits for its next
token, and what every rank holds in memory, for tp = 1, 2, 4 on CPU ranks, beside a plain
tp SGLang server restarted from disk (what a user without the engine waits for).

Per tp size, one engine (``--tp-size N``; sglang_kv='server', the shadow re-prefills), N
streamed native requests of C-token contexts: a fault-free run (the reference ids), then
the same prompts again with the serving server's highest rank (``sglang::scheduler_TP<N-1>``)
SIGKILLed once every request has ``--kill-after`` ids: kill -> that request's next token at
the client, and whether the ids equal the reference. Memory: PSS / private MiB of each
scheduler process (one per rank) of the worker and of the shadow, and of the arena (the one
copy of every rank's weights). ``--plain``: a plain SGLang server at the same tp started
from disk, start -> its first token of one of the prompts (the restart a failure costs).

    python benchmarks/tp_handover.py --tp 1,2 --cells 256x4                  # the 2-core dev VM
    python benchmarks/tp_handover.py --tp 1,2,4 --threads 2 --cells 1024x8 --plain  # 16 cores
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import _procmem as procmem  # benchmarks/, on sys.path when run as a script
from _plotting import pyplot, save_result
from _sglang_cold_disk import wait_healthy
from handover_at_scale import _first_diff, _stats, run_cell

from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig


def _rank_memory(members: dict[int, str]) -> dict[str, dict]:
    out = {}
    for pid, title in sorted(members.items(), key=lambda m: m[1]):
        try:
            m = procmem.rollup(pid)
        except OSError:
            continue
        out[title.removeprefix("sglang::")] = {"pss": round(m["pss"], 1), "private": round(m["private"], 1)}
    return out


def run_tp(tp: int, args, rng: random.Random) -> dict:
    router = RouterConfig(request_wait_s=900, stall_timeout_s=120.0)
    worker_args = ["--tp-size", str(tp), "--context-length", str(args.context)] + args.worker_arg
    t0 = time.monotonic()
    with RecoverableEngine.launch(backend="sglang", model=args.model_dir, router=router, sglang_venv=args.sglang_venv,
                                  worker_args=worker_args, sglang_kv="server", sglang_kv_tokens=args.kv_tokens,
                                  start_timeout_s=900) as engine:
        engine.wait_ready(timeout=900, stable=True)
        sup = engine.supervisor
        slot = sup.slots[0]
        entry = {"tp": tp, "start_s": round(time.monotonic() - t0, 1), "cells": {},
                 "memory": {"arena": procmem.tree_mib(slot.arena.pid)[1],
                            "worker_ranks": _rank_memory(sup._procs.members(slot.worker)),
                            "shadow_ranks": _rank_memory(sup._procs.members(slot.shadow))}}
        for context, inflight in args.cells:
            prompts = [[rng.randrange(1, args.vocab) for _ in range(context - args.max_new)] for _ in range(inflight)]
            reference = asyncio.run(run_cell(engine, prompts, args.max_new, None))
            engine.wait_ready(timeout=900, stable=True)
            members = sup._procs.members(sup.slots[0].worker)
            # the highest rank's scheduler (at tp 1 SGLang names it plain ``sglang::scheduler``)
            victim = max((title, pid) for pid, title in members.items() if title.startswith("sglang::scheduler"))[1]
            killed = asyncio.run(run_cell(engine, prompts, args.max_new, args.kill_after,
                                          kill=lambda victim=victim: os.kill(victim, signal.SIGKILL)))
            engine.wait_ready(timeout=900, stable=True)
            detected = [e for e in engine.events() if e["event"] == "detected"][-1]
            per = [{"next_token_s": k["next_token_s"], "first_diff": _first_diff(k["ids"], r["ids"])}
                   for k, r in zip(killed, reference, strict=True)]
            entry["cells"][f"{context}x{inflight}"] = {
                "next_token_s": _stats([p["next_token_s"] for p in per]),
                "identical": sum(p["first_diff"] is None for p in per), "inflight": inflight,
                "detected": {k: v for k, v in detected.items() if isinstance(v, int | float | str)}, "requests": per}
            cell = entry["cells"][f"{context}x{inflight}"]
            print(f"tp {tp} {context}x{inflight}: next token {cell['next_token_s']}, identical "
                  f"{cell['identical']}/{inflight}", flush=True)
    return entry


def plain_restart(tp: int, args, prompt: list[int]) -> dict:
    """A plain SGLang server at ``tp`` from disk: start -> the first token of ``prompt``."""
    from belayer_engine.backends.sglang.launcher import SGLangServerConfig, server_argv, server_env
    from belayer_engine.backends.sglang.model_dir import ensure_embedded_model
    from belayer_engine.common.net import free_port

    cfg = SGLangServerConfig(model_path=args.model_dir or str(ensure_embedded_model()), port=free_port(),
                             venv=args.sglang_venv, max_total_tokens=args.kv_tokens, context_length=args.context,
                             extra_args=["--tp-size", str(tp), *args.worker_arg])
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as log:  # the server's output: an error names its last lines
        proc = subprocess.Popen(server_argv(cfg), env=server_env(cfg), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return _first_token(proc, log, f"http://127.0.0.1:{cfg.port}", prompt, tp, t0)
        finally:
            with contextlib.suppress(ProcessLookupError):  # exited by itself
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _first_token(proc, log, url: str, prompt: list[int], tp: int, t0: float) -> dict:
    try:
        wait_healthy(proc, url)
    except RuntimeError as exc:
        log.seek(0)
        raise RuntimeError(f"{exc}: {log.read().decode(errors='replace')[-1500:]}") from exc
    body = json.dumps({"input_ids": prompt, "stream": True,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as resp:
        for line in resp:
            if line.startswith(b"data:"):
                return {"tp": tp, "start_to_first_token_s": round(time.monotonic() - t0, 2)}
    raise RuntimeError(f"plain tp {tp} server sent no token")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes, one engine each")
    p.add_argument("--cells", default="256x4", help="CONTEXTxINFLIGHT,...")
    p.add_argument("--threads", type=int, default=1, help="cores of each rank (OMP threads, the engine's binding)")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--sglang-venv", default=None)
    p.add_argument("--kv-tokens", type=int, default=8192)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--kill-after", type=int, default=12)
    p.add_argument("--vocab", type=int, default=500)
    p.add_argument("--worker-arg", action="append", default=[])
    p.add_argument("--plain", action="store_true", help="also time a plain SGLang server's restart from disk")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    args.cells = [tuple(int(v) for v in c.split("x")) for c in args.cells.split(",")]
    if args.threads > 1:
        os.environ["BELAYER_SGLANG_CPU_THREADS"] = str(args.threads)
    path = Path(args.out) / f"tp_handover_cpu{'_' + args.tag if args.tag else ''}.json"
    result = {"question": "kill one rank -> next token per request, and memory per rank, by tp (CPU ranks)",
              "machine": {"host": platform.node(), "cpus": os.cpu_count(), "cpu": platform.processor()},
              "args": {k: v for k, v in vars(args).items() if k != "out"}, "tp": {}, "plain": {}}

    def save() -> None:
        save_result(result, path, _plot)

    rng = random.Random(0)
    for tp in (int(v) for v in args.tp.split(",")):
        try:
            result["tp"][str(tp)] = run_tp(tp, args, rng)
        except Exception as exc:  # one size's failure is a result too
            result["tp"][str(tp)] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"tp {tp} failed: {exc}", file=sys.stderr, flush=True)
        if args.plain:
            prompt = [random.Random(1).randrange(1, args.vocab) for _ in range(args.cells[0][0] - args.max_new)]
            try:
                result["plain"][str(tp)] = plain_restart(tp, args, prompt)
            except Exception as exc:  # as for the engine: one size's failure is a result too
                result["plain"][str(tp)] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"plain tp {tp}: {result['plain'][str(tp)]}", flush=True)
        save()
    print(f"wrote {path}")


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    sizes = [t for t, v in result["tp"].items() if v.get("cells")]
    if not sizes:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    cell = next(iter(result["tp"][sizes[0]]["cells"]))
    engine = [1e3 * result["tp"][t]["cells"][cell]["next_token_s"].get("p50", 0) for t in sizes]
    ax.bar([i - 0.2 for i in range(len(sizes))], engine, 0.4, label=f"engine: kill a rank -> next token p50 ({cell})")
    plain = [1e3 * (result["plain"].get(t) or {}).get("start_to_first_token_s", 0) for t in sizes]
    if any(plain):
        ax.bar([i + 0.2 for i in range(len(sizes))], plain, 0.4, label="plain SGLang: restart -> first token")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"tp {t}" for t in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title(f"CPU ranks, {result['machine']['cpus']} cores", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
