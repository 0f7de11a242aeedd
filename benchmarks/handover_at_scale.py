"""Kill -> next token for every request in flight, as a function of the work (SGLang backend).

One question: how long does each client wait for its next token when the serving SGLang
server is SIGKILLed, with N streamed requests of C-token contexts in flight and a KV pool of
P tokens, for each way the engine can hold the KV:

- ``adopt``: the pool lives in the arena; the shadow adopts the dead server's requests with
  their KV (sglang_kv="arena", the default);
- ``resident``: each server owns its pool, the idle shadow keeps its own (sglang_kv="server");
- ``released``: the same, the idle shadow's pool released by the memory saver and resumed on
  promotion (GPU with torch_memory_saver);
- ``replay``: resident, with the generated ids decoded again, forced (recovery="replay").

Each cell (C, N) runs once without a fault (the reference ids), then again with the kill
once every request has ``--kill-after`` tokens; the engine re-arms its shadow in between.
Per request: kill -> its next token at the client, the first id that differs from the
reference, the ids the continuation found in the cache (``adopted_tokens``). The engine's
processes' memory is read once per mode; ``--plain`` also starts a plain SGLang server at the
same KV pool. JSON + plot in benchmarks/results/ (written after every cell).

    python benchmarks/handover_at_scale.py --cells 128x1,1024x4 --kv-tokens 8192      # CPU
    bash benchmarks/sglang_gpu_env.sh python3 benchmarks/handover_at_scale.py --device cuda:0 \\
        --model-dir DIR --kv-tokens 300000 --context 40960 --cells 128x1,2048x16,8192x16 --modes adopt,released
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _procmem as procmem  # benchmarks/, on sys.path when run as a script
import _scale_plot
import aiohttp
from _sglang_cold_disk import wait_healthy

from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig

MODES = {"adopt": ({"sglang_kv": "arena"}, "token"), "resident": ({"sglang_kv": "server", "sglang_shadow_memory_saver": False}, "token"),
         "released": ({"sglang_kv": "server", "sglang_shadow_memory_saver": True}, "token"),
         "replay": ({"sglang_kv": "server", "sglang_shadow_memory_saver": False}, "replay")}
PROFILE_S = 8  # s (py-spy takes whole seconds): from before the cell's requests to past the handover (GPU)


async def _stream(session, base: str, ids: list[int], max_new: int, rec: dict) -> None:
    """One streamed native request; ``rec`` gets (monotonic time, ids so far) per chunk."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                                   "ignore_eos": True}}
    rec.update(chunks=[], ids=[], meta={})
    async with session.post(base + "/generate", json=body) as resp:
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                continue
            data = json.loads(line[5:])
            if "error" in data:
                raise RuntimeError(f"request failed: {data['error']}")
            if len(data.get("output_ids", [])) > len(rec["ids"]):
                rec["ids"] = list(data["output_ids"])
                rec["chunks"].append((time.monotonic(), len(rec["ids"])))
            rec["meta"] = data.get("meta_info", rec["meta"])


async def run_cell(engine, prompts: list[list[int]], max_new: int, kill_after: int | None, kill=None) -> list[dict]:
    """The prompts streamed at once; with ``kill_after``, ``kill()`` (default: SIGKILL the
    serving server's process group) once every request has that many ids."""
    base = engine.base_url.removesuffix("/v1")
    recs = [{} for _ in prompts]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [asyncio.create_task(_stream(session, base, p, max_new, r)) for p, r in zip(prompts, recs, strict=True)]
        t_kill = t_kill_wall = None
        if kill_after is not None:
            while min(len(r.get("ids", [])) for r in recs) < kill_after:
                ended = [(t, r) for t, r in zip(tasks, recs, strict=True) if t.done()]
                if ended:
                    for t in tasks:
                        t.cancel()
                    task, rec = ended[0]
                    why = (task.exception() if not task.cancelled() else None) or \
                        f"finished after {len(rec.get('ids', []))} ids: {rec.get('meta', {}).get('finish_reason')}"
                    raise RuntimeError(f"a request ended before the kill point at {kill_after} ids ({why}); "
                                       "is the KV pool large enough for the cell?")
                await asyncio.sleep(0.002)
            t_kill, t_kill_wall = time.monotonic(), time.time()
            if kill is None:
                os.killpg(engine.worker_pid(0), signal.SIGKILL)
            else:
                kill()
        await asyncio.gather(*tasks)
    for r in recs:
        r["t_kill"], r["t_kill_wall"] = t_kill, t_kill_wall
        if t_kill is not None:
            failures = (r["meta"].get("belayer") or {}).get("failures") or [{}]
            # the replacement's first token: past what the router had when it saw the failure
            # (ids the dead worker made before the kill may still reach the client after it)
            r["at_failure"] = at = failures[0].get("at_token", 0)
            r["at_kill"] = max([n for t, n in r["chunks"] if t <= t_kill], default=0)
            after = [t for t, n in r["chunks"] if t > t_kill and n > at]
            r["next_token_s"] = (after[0] - t_kill) if after else None
            # the router's side of the wait (wall clock, s after the kill): failure seen, re-sent,
            # the replacement's first token at the router
            r["router_s"] = {name: failures[0][key] - t_kill_wall for name, key in
                             (("seen", "t"), ("resent", "resent_t"), ("headers", "headers_t"),
                              ("first_token", "first_token_t"))
                             if isinstance(failures[0].get(key), float)}
    return recs


def _kv_log(run_dir: Path, seen: set) -> list[str]:
    """New lines the servers' KV hook logged (adoption, skipped rows) since the last call."""
    out = []
    for log in sorted(run_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "belayer kv:" in line and (log.name, line) not in seen:
                seen.add((log.name, line))
                out.append(f"{log.stem}: {line.split('belayer kv:', 1)[1].strip()}")
    return out


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _stats(xs: list[float]) -> dict:
    xs = sorted(x for x in xs if x is not None)
    return {"p50": statistics.median(xs), "max": xs[-1], "min": xs[0], "n": len(xs)} if xs else {"n": 0}


def _memory(engine) -> dict:
    gpu = procmem.gpu_mib()
    sup = engine.supervisor
    slot = sup.slots[0]
    out = {}
    for role, proc in (("arena", slot.arena), ("worker", slot.worker), ("shadow", slot.shadow)):
        if proc is None:
            continue
        out[role] = {"gpu_mib": procmem.tree_gpu_mib(gpu, proc.pid), "host": procmem.tree_mib(proc.pid)[1],
                     "gpu_parts": procmem.gpu_by_process(gpu, proc.pid)}
    if gpu:
        out["engine_gpu_mib"] = sum(v["gpu_mib"] or 0 for v in out.values())
    return out


def _plain_memory(args) -> dict:
    """A plain SGLang server at the same KV pool: its memory once ready (the baseline)."""
    from belayer_engine.backends.sglang.launcher import SGLangServerConfig, server_argv, server_env
    from belayer_engine.backends.sglang.model_dir import ensure_embedded_model
    from belayer_engine.common.net import free_port

    model = args.model_dir or str(ensure_embedded_model())
    # the engine's own sizes (the same KV pool, context and batch) and the workers' own flags
    # (SGLang's deterministic mode takes more per server: a worker of 2,478 MiB with it, 1,978
    # without, on H100s of two calls)
    pool = args.plain_pool
    cfg = SGLangServerConfig(model_path=model, port=free_port(), device=args.device, venv=args.sglang_venv,
                             max_total_tokens=pool["kv_tokens"], extra_args=pool["argv"] + args.worker_arg)
    proc = subprocess.Popen(server_argv(cfg), env=server_env(cfg), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{cfg.port}")
        gpu = procmem.gpu_mib()
        return {"gpu_mib": procmem.tree_gpu_mib(gpu, proc.pid), "host": procmem.tree_mib(proc.pid)[1],
                "gpu_parts": procmem.gpu_by_process(gpu, proc.pid)}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_mode(mode: str, args, result: dict, save) -> None:
    options, recovery = MODES[mode]
    router = RouterConfig(request_wait_s=900, stall_timeout_s=120.0, recovery=recovery)
    worker_args = (["--context-length", str(args.context)] if args.context else []) + \
        (["--max-running-requests", str(args.max_running)] if args.max_running else []) + args.worker_arg
    sizes = {"sglang_kv_tokens": args.kv_tokens} if args.kv_tokens else {}
    if args.kv_reserve is not None and options.get("sglang_kv") == "arena":  # the other modes have no reserve
        sizes["sglang_kv_reserve_tokens"] = args.kv_reserve
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    with RecoverableEngine.launch(backend="sglang", device=args.device, model=args.model_dir, router=router,
                                  sglang_venv=args.sglang_venv, worker_args=worker_args, start_timeout_s=900,
                                  **sizes, **options) as engine:
        engine.wait_ready(timeout=900, stable=True)
        backend = engine.supervisor._procs.backend
        result["pool"] = {"kv_tokens": backend.kv_tokens, "reserve_tokens": backend.kv_reserve_tokens,
                          "argv": backend.sizes}
        entry = result["modes"].setdefault(mode, {"start_s": time.monotonic() - t0, "memory": _memory(engine),
                                                   "kv_tokens": backend.kv_tokens, "cells": {}})
        save()
        vocab = args.vocab
        seen: set = set()
        entry["kv_log"] = _kv_log(engine.supervisor.run_dir, seen)
        for context, inflight in args.cells:
            length = context - args.max_new
            prompts = [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(inflight)]
            reference = asyncio.run(run_cell(engine, prompts, args.max_new, None))
            engine.wait_ready(timeout=900, stable=True)
            # the fault-free run's time between two ids at the client: one decode step of the cell
            gaps = [b[0] - a[0] for r in reference for a, b in zip(r["chunks"][1:], r["chunks"][2:], strict=False)]
            entry.setdefault("decode_step_s", {})[f"{context}x{inflight}"] = _stats(gaps)
            for n, kill_after in enumerate(args.kill_after):
                key = f"{context}x{inflight}" + (f"@{kill_after}" if len(args.kill_after) > 1 else "")
                if (times := args.kill_after[:n + 1].count(kill_after)) > 1:  # the same point again: its own cell
                    key += f"-{times}"
                # no "@" in a file name: the GPU machine's tool does not bring such files back
                stem = f"{args.out}/handover_at_scale_{args.tag or 'run'}_{key.replace('@', '_at')}"
                profile = Path(f"{stem}_pyspy.json") if args.profile or args.profile_native else None
                states = Path(f"{stem}_threads.json") if args.thread_states else None
                entry["cells"][key] = _killed_cell(engine, prompts, reference, args.max_new, kill_after, seen,
                                                   profile, args.profile_native, args.profile_seconds, states)
                entry["cells"][key].update(context=context, inflight=inflight)
                cell = entry["cells"][key]
                router = {k: (v.get("p50"), v.get("max")) for k, v in cell["router_s"].items()}
                print(f"{mode} {key}: next token {cell['next_token_s']}, identical {cell['identical']}/{inflight}; "
                      f"router (p50, max s after the kill) {router}; router loop stall {cell['loop_stall']}",
                      flush=True)
            save()


def _killed_cell(engine, prompts, reference, max_new: int, kill_after: int, seen: set,
                 profile: Path | None = None, native: bool = False, profile_s: int = PROFILE_S,
                 states: Path | None = None) -> dict:
    """The cell's prompts again, the serving server SIGKILLed once each has ``kill_after`` ids
    (with ``profile``: while py-spy samples the shadow's processes, see ``_profiled_kill``;
    with ``states``: while ``_thread_states.py`` samples its HTTP process's threads)."""
    spy = []
    kill = _profiled_kill(engine, profile, spy, native, profile_s) if profile is not None else None
    sampler = _thread_sampler(engine, states, profile_s) if states is not None else None
    killed = asyncio.run(run_cell(engine, prompts, max_new, kill_after, kill))
    for record in spy:
        record["proc"].wait(timeout=record["seconds"] + 120)
    thread_states = _thread_states_around(sampler, states, killed[0]["t_kill"], profile_s) if sampler else None
    if profile is not None:  # when each of the shadow's threads was busy around the kill, beside the profile
        from _pyspy_timeline import timeline

        kill_ms = 1e3 * spy[0]["kill_s"]  # on py-spy's clock, give or take its start (~ms)
        profile.with_suffix(".timeline.txt").write_text(
            f"kill at ~{kill_ms:.0f} ms\n" + timeline(profile, thread="", since_ms=kill_ms - 50, until_ms=kill_ms + 400) + "\n")
    engine.wait_ready(timeout=900, stable=True)
    events = engine.events()
    handover = [e for e in events if e["event"] == "handover"][-1]
    detected = max(i for i, e in enumerate(events) if e["event"] == "detected")
    # how long the shadow that took over had been ready: a long-idle one may answer slower
    ready = [e for e in events[:detected] if e["event"] == "shadow_ready"]
    shadow_ready_s = killed[0]["t_kill_wall"] - ready[-1]["wall"] if ready and "wall" in ready[-1] else None
    per = []
    for k, r in zip(killed, reference, strict=True):
        belayer = k["meta"].get("belayer") or {}
        per.append({"next_token_s": k["next_token_s"], "at_kill": k["at_kill"], "at_failure": k["at_failure"],
                    "first_diff": _first_diff(k["ids"], r["ids"]), "adopted_tokens": belayer.get("adopted_tokens"),
                    "reprefilled_tokens": belayer.get("reprefilled_tokens"), "recoveries": belayer.get("recoveries"),
                    "router_s": k.get("router_s", {})})
    router = {name: _stats([p["router_s"].get(name) for p in per])
              for name in ("seen", "resent", "headers", "first_token")}
    stall = [e for e in events[detected:] if e["event"] == "loop_stall"]
    return {"kill_after": kill_after, "next_token_s": _stats([p["next_token_s"] for p in per]), "router_s": router,
            "kill_wall": killed[0]["t_kill_wall"],  # the servers' log lines give wall times too
            "identical": sum(p["first_diff"] is None for p in per), "handover_s": handover.get("total_s"),
            "shadow_ready_before_kill_s": shadow_ready_s,
            # the router's loop: the longest it went without running after the handover, and when
            "loop_stall": {k: stall[0][k] for k in ("longest_s", "began_s")} if stall else None,
            "events": [{k: v for k, v in e.items() if isinstance(v, int | float | str | bool)}
                       for e in events[detected:detected + 12]],  # detection, fence, promotion, routing
            "kv_log": _kv_log(engine.supervisor.run_dir, seen), "requests": per,
            **({"thread_states": thread_states} if thread_states is not None else {})}


def _shadow(engine, option: str):
    """The slot's waiting shadow, which ``option`` samples."""
    shadow = engine.supervisor.slots[0].shadow
    if shadow is None:
        raise SystemExit(f"{option}: the slot has no shadow to sample")
    return shadow


def _thread_sampler(engine, out: Path, seconds: int) -> subprocess.Popen:
    """``_thread_states.py`` on the shadow's HTTP process (the server's own pid) for ``seconds``,
    started before the cell's requests; returns once it samples."""
    shadow = _shadow(engine, "--thread-states")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_thread_states.py"), "--pid", str(shadow.pid),
                             "--seconds", str(seconds), "--out", str(out)], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "sampling":  # one line, then nothing: the pipe never fills
        proc.kill()
        raise RuntimeError(f"_thread_states.py did not start on pid {shadow.pid} (exit {proc.wait()})")
    return proc


def _thread_states_around(proc: subprocess.Popen, out: Path, t_kill: float, seconds: int) -> str:
    """Each thread's runs of one state from 50 ms before the kill to 400 ms after (the same
    monotonic clock), beside the JSON (kept for the 0.2 s before the kill to 1 s after)."""
    from _thread_states import summary, window

    proc.wait(timeout=seconds + 60)
    data = json.loads(out.read_text())
    if not data["t"] or data["t"][-1] < t_kill + 0.4:
        last = f"{data['t'][-1] - t_kill:+.2f} s from the kill" if data["t"] else "without a sample"
        return f"the sampler stopped ({last}) before the kill's window ended: raise --profile-seconds"
    out.write_text(json.dumps(window(data, t_kill - 0.2, t_kill + 1.0)))
    text = f"times in ms from 50 ms before the kill\n{summary(data, t_kill - 0.05, t_kill + 0.4)}"
    out.with_suffix(".txt").write_text(text + "\n")
    return text


def _profiled_kill(engine, out: Path, spies: list, native: bool = False, seconds: int = PROFILE_S):
    """Starts py-spy on the shadow (its HTTP process, scheduler and detokenizer:
    ``--subprocesses``, every thread, 2 kHz, not pausing them) for ``seconds`` and waits until
    it samples (before the cell's requests are sent: starting it at the kill point let the
    streams run on meanwhile); returns the kill, a SIGKILL of the serving server. The profile
    shows what each shadow process runs, or where it waits (``--idle``: waiting threads are
    sampled too), around the handover. Chrome trace (timed samples: ``_pyspy_timeline.py``
    says when each thread was busy). ``native``: C/C++ frames too (a thread inside a driver
    call or waiting for the GIL shows where, not as an idle Python frame) of the HTTP process
    only, 1 kHz: each sample pauses it (the scheduler and detokenizer run unpaused). ``spies``
    gets the py-spy process, its start and the kill's time after it (monotonic s)."""
    if shutil.which("py-spy") is None:
        raise SystemExit("--profile needs py-spy on PATH (pip install py-spy; on the GPU machine carry its binary)")
    shadow = _shadow(engine, "--profile")
    # native stacks need the process paused per sample: the HTTP process alone then (its
    # loop's stalls after an adoption run no Python: C code holding the GIL)
    how = ["--native", "--rate", "1000"] if native else ["--subprocesses", "--nonblocking", "--rate", "2000"]
    said = out.with_suffix(".pyspy.log")
    with said.open("w") as log_file:  # a file, not a pipe py-spy could fill and block on
        t0 = time.monotonic()
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(shadow.pid), "--threads", "--idle",
                                *how, "--duration", str(seconds), "--format", "chrometrace", "--output", str(out)],
                               stdout=log_file, stderr=subprocess.STDOUT, text=True)
    record = {"proc": spy, "t0": t0, "kill_s": None, "seconds": seconds}
    spies.append(record)
    while "Sampling process" not in said.read_text():  # py-spy says when it samples
        if spy.poll() is not None or time.monotonic() - t0 > 120:
            spy.kill()
            raise RuntimeError(f"py-spy did not start on pid {shadow.pid}: {said.read_text()[-500:]}")
        time.sleep(0.05)

    def kill() -> None:
        record["kill_s"] = time.monotonic() - t0
        os.killpg(engine.worker_pid(0), signal.SIGKILL)

    return kill


def _cells(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in cell.split("x")) for cell in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-dir", default=None, help="HF dir (GPU: ensure_embedded_model(cfg=ModelConfig.qwen3_4b()))")
    p.add_argument("--sglang-venv", default=None)
    p.add_argument("--modes", default="adopt,resident")
    p.add_argument("--cells", type=_cells, default=_cells("128x1,1024x4"), help="CONTEXTxINFLIGHT,...")
    p.add_argument("--kv-tokens", type=int, default=None, help="the KV pool (every server's --max-total-tokens); "
                   "default: the engine's (GPU: 0.8 of the device after the weights; CPU: 4,096)")
    p.add_argument("--kv-reserve", type=int, default=None, help="adopt mode: the pool's reserve beside it "
                   "(sglang_kv_reserve_tokens; default: the engine's, 1/64 of the pool within [512, 4,096])")
    p.add_argument("--context", type=int, default=None, help="the servers' --context-length (default: the engine's)")
    p.add_argument("--max-running", type=int, default=None, help="--max-running-requests (default: the engine's)")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--kill-after", type=lambda t: [int(v) for v in t.split(",")], default=[16],
                   help="kill once every request has this many new ids; several (16,40): one kill each")
    p.add_argument("--vocab", type=int, default=500, help="prompt ids are drawn from [1, vocab)")
    p.add_argument("--worker-arg", action="append", default=[])
    p.add_argument("--plain", action="store_true", help="also measure a plain SGLang server's memory at the same KV")
    p.add_argument("--profile", action="store_true", help="py-spy samples the shadow's processes for --profile-seconds "
                   "from before each cell's requests (a chrome trace and its per-thread timeline around the kill beside "
                   "the JSON; needs py-spy on PATH)")
    p.add_argument("--profile-native", action="store_true", help="--profile of the shadow's HTTP process only, "
                   "with C/C++ frames, 1 kHz (py-spy --native pauses the process per sample; over every process at "
                   "500 Hz the H100's handover took 1.6 s and ms-long stalls were sampled too sparsely to place)")
    p.add_argument("--thread-states", action="store_true", help="sample every thread of the shadow's HTTP process "
                   "from another process (benchmarks/_thread_states.py: state, CPU time, system call at 1 kHz, no "
                   "pause, for --profile-seconds from before each cell's requests): the cell's thread_states says "
                   "what each ran from 50 ms before the kill to 400 ms after (a thread waiting for the GIL sits in "
                   "futex)")
    p.add_argument("--profile-seconds", type=int, default=PROFILE_S, help="how long py-spy (or --thread-states) "
                   "samples, from before the cell's requests: their prefill and decode to the kill point, then the handover (CPU: ~60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    name = f"handover_at_scale_{args.device.replace(':', '')}{'_' + args.tag if args.tag else ''}"
    path = Path(args.out) / f"{name}.json"
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip() if args.device != "cpu" else None
    result = {"question": "kill -> next token per request in flight, by context, in-flight count and KV mode",
              "machine": {"host": platform.node(), "cpus": os.cpu_count(), "gpu": gpu},
              "args": {k: v for k, v in vars(args).items() if k != "out"}, "modes": {}, "plain": None}

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        _scale_plot.plot(result, path.with_suffix(".png"))

    for mode in args.modes.split(","):
        try:
            run_mode(mode, args, result, save)
        except Exception as exc:  # one mode's failure is a result too; the others still run
            result["modes"].setdefault(mode, {})["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"{mode} failed: {exc}", file=sys.stderr, flush=True)
            save()
    if args.plain and result.get("pool"):
        args.plain_pool = result["pool"]
        result["plain"] = _plain_memory(args)
        save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
