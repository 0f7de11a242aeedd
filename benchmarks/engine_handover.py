"""SIGKILL a worker mid-stream; measure how long the client waits for the next token.

Compares (a) a cold restart of the worker (no shadow) with (b) a shadow handover, side by
side on the same machine, and token-level recovery with the coarse every-k scheme (tokens
regenerated). Writes JSON and a plot to ``benchmarks/results/``.

    python benchmarks/engine_handover.py                 # CPU, embedded small model
    python benchmarks/engine_handover.py --device cuda:0 --arena-arg=--preset --arena-arg=qwen3-4b
    python benchmarks/engine_handover.py --device cuda:0 --model-dir DIR --repeats 4 --regen-repeats 2
    python benchmarks/engine_handover.py --backend sglang --repeats 2 --regen-repeats 0   # real SGLang servers

Kill-to-first-token is measured from the ``kill()`` call to the arrival at the client of
the first token produced by the replacement worker (the token at the failure index);
detection latency from ``kill()`` to the supervisor's ``detected`` event (same clock:
the engine runs in this process). Each run is broken down along the critical path
(``breakdown``): detect (kill -> ``detected``), fence (-> ``fenced``: SIGKILL of the group,
reaped), health (-> ``arena_checked``; ``health_took_s`` is the check itself, which runs
during the fence), activate (-> ``activated``; cold: the worker's cold start), route
(-> ``routed``), resend (-> the router's new ``/generate``), first_chunk (-> its first token
at the router; ``reprefill_s`` is the worker's own request-to-first-token time, i.e. the
re-prefill of prompt + generated), deliver (-> the client has it).
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
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import aclosing
from pathlib import Path

import _procmem as procmem  # benchmarks/, on sys.path when run as a script

from belayer_engine.client import EngineClient
from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig

PROMPT = "The belay device holds the rope when"
SENDS: list[dict] = []  # every /generate the router sent: monotonic send / first-token times


def _instrument_router() -> None:
    """Time the router's upstream calls (the engine, hence the router, runs in this process)."""
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


def _breakdown(events: list[dict], t_kill: float, t_client: float) -> dict:
    """Critical-path segments of one kill (see the module docstring)."""
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


async def _stream(base_url: str, max_tokens: int, kill_at: int, pid: int) -> dict:
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
                                  worker_args=args.worker_arg, start_timeout_s=900, **_backend(args)) as eng:
        eng.wait_ready(timeout=900)
        asyncio.run(_stream(eng.base_url, 8, 10**9, 0))  # warm-up (nothing killed)
        reference = asyncio.run(_stream(eng.base_url, args.max_tokens, 10**9, 0))["ids"] if args.identity else None
        for _ in range(args.repeats):
            eng.wait_ready(timeout=600, stable=True)
            pid = eng.worker_pid(0)
            kill_at = rng.randint(args.max_tokens // 4, args.max_tokens // 2)
            r = asyncio.run(_stream(eng.base_url, args.max_tokens, kill_at, pid))
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
                "breakdown": _breakdown(eng.events(), r["t_kill"], first_new),
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


def measure_cold_disk(args, rng: random.Random) -> list[dict]:
    """The baseline without Belayer: one plain SGLang server loading its weights from disk;
    SIGKILL its process group mid-stream, start a new one, re-send. Kill -> first token of
    the re-sent request (that restart is all a user without a shadow can do)."""
    from belayer_engine.backends.sglang.launcher import SGLangServerConfig, server_argv, server_env
    from belayer_engine.backends.sglang.model_dir import ensure_embedded_model
    from belayer_engine.common.net import free_port

    model = args.model_dir or str(ensure_embedded_model())
    runs = []

    def start() -> tuple[subprocess.Popen, str]:
        cfg = SGLangServerConfig(model_path=model, port=free_port(), device=args.device, venv=args.sglang_venv)
        log = open(Path(args.out) / f"cold_disk_server_{cfg.port}.log", "wb")  # noqa: SIM115 - closed with the server
        proc = subprocess.Popen(server_argv(cfg), env=server_env(cfg), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        return proc, f"http://127.0.0.1:{cfg.port}"

    def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"SGLang server at {url} not healthy after {timeout:.0f}s")

    def stream(url: str, max_tokens: int):
        body = json.dumps({"text": PROMPT, "stream": True, "sampling_params": {
            "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}).encode()
        req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as resp:
            for line in resp:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    yield json.loads(line[6:])

    proc, url = start()
    try:
        wait_healthy(proc, url)
        next(iter(stream(url, 8)))  # one request, as the engine's worker has served before it is measured
        plain_gpu = procmem.tree_gpu_mib(procmem.gpu_mib(), proc.pid)
        print("cold-disk server GPU MiB", plain_gpu, flush=True)
        for _ in range(args.repeats):
            kill_at = rng.randint(args.max_tokens // 4, args.max_tokens // 2)
            got = 0
            try:
                for chunk in stream(url, args.max_tokens):
                    got = len(chunk.get("output_ids") or [])
                    if got >= kill_at:
                        t_kill = time.monotonic()
                        os.killpg(proc.pid, signal.SIGKILL)
                        break
            except OSError:
                pass
            proc.wait()
            proc, url = start()
            wait_healthy(proc, url)
            t_healthy = time.monotonic()
            first = next(iter(stream(url, args.max_tokens - got)))
            t_first = time.monotonic()
            runs.append({"kill_at_client_token": kill_at, "failure_at_token": got,
                         "kill_to_first_token_s": t_first - t_kill, "detection_s": None,
                         "handover_path": "cold-disk", "restart_to_healthy_s": t_healthy - t_kill,
                         "supervisor_handover_s": None, "routed_to_first_token_s": t_first - t_healthy,
                         "breakdown": {"restart_s": t_healthy - t_kill, "first_chunk_s": t_first - t_healthy},
                         "first_ids": len(first.get("output_ids") or []), "plain_server_gpu_mib": plain_gpu})
            print("cold-disk", json.dumps(runs[-1]), flush=True)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return runs


def _backend(args) -> dict:
    if args.backend != "sglang":
        return {}
    saver = {"auto": None, "on": True, "off": False}[args.sglang_shadow_memory_saver]
    return {"backend": "sglang", "sglang_venv": args.sglang_venv, "sglang_shadow_memory_saver": saver,
            "sglang_shadow_release_graphs": args.sglang_shadow_release_graphs or None,
            "sglang_cuda_stack_bytes": args.sglang_cuda_stack_bytes}


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


def regenerated(args, rng: random.Random) -> dict:
    """Tokens regenerated after a kill at a random point: token-level vs every-k."""
    out = {}
    for recovery in ("token", "chunk"):
        router = RouterConfig(recovery=recovery, chunk_tokens=args.chunk_tokens)
        vals = out[recovery] = []
        if args.regen_repeats == 0:
            continue
        with RecoverableEngine.launch(workers=1, shadow=True, device=args.device, model=args.model_dir, router=router,
                                      unhealthy_window_s=0.0, arena_args=args.arena_arg, start_timeout_s=600,
                                      **_backend(args)) as eng:
            for _ in range(args.regen_repeats):
                eng.wait_ready(timeout=600, stable=True)
                kill_at = rng.randint(args.chunk_tokens // 2, args.regen_tokens - 16)
                r = asyncio.run(_stream(eng.base_url, args.regen_tokens, kill_at, eng.worker_pid(0)))
                vals.append({"failure_at_token": r["summary"]["failures"][0]["at_token"],
                             "regenerated": r["summary"]["regenerated_tokens"], "diverged": r["summary"].get("diverged")})
                print(recovery, json.dumps(vals[-1]), flush=True)
    return out


def _stats(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    return ({"mean": statistics.fmean(xs), "p50": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
            if xs else {})


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
    regen = result["regenerated"]
    mem = (result.get("shadow") or {}).get("memory") or {}
    if not all(regen.get(k) for k in ("token", "chunk")) and mem.get("shadow_gpu_mib"):
        b.bar(["serving worker", "shadow (idle)"], [mem["worker_gpu_mib"], mem["shadow_gpu_mib"]], color=["#48c", "#4a4"])
        b.set_ylabel("own GPU memory, MiB (weights in the arena)")
        b.set_title("GPU memory per SGLang server")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return
    if not all(regen.get(k) for k in ("token", "chunk")):
        b.set_axis_off()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return
    b.bar(["token-level", f"every {result['chunk_tokens']}"],
          [statistics.fmean(v["regenerated"] for v in regen[k]) for k in ("token", "chunk")], color=["#4a4", "#c84"])
    b.set_ylabel("tokens regenerated per failure (mean)")
    b.set_title("recovery granularity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", choices=["reference", "sglang"], default="reference")
    p.add_argument("--modes", default="cold,shadow", help="which of cold,shadow,cold-disk to run (split a long GPU "
                   "run); cold-disk: a plain SGLang server restarted from disk, the no-Belayer baseline")
    p.add_argument("--sglang-shadow-memory-saver", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--sglang-venv", default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--arena-arg", action="append", default=[], help="extra arena option (repeatable)")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra worker option, e.g. --worker-arg=--enable-deterministic-inference (repeatable)")
    p.add_argument("--sglang-shadow-release-graphs", action="store_true",
                   help="the SGLang shadow also releases its decode CUDA graphs while idle")
    p.add_argument("--sglang-cuda-stack-bytes", type=int, default=None,
                   help="each SGLang server's CUDA per-thread stack limit (default 256; 0: the driver's 1 KiB)")
    p.add_argument("--recovery", choices=["token", "replay"], default="token",
                   help="how a killed stream continues: re-prefill (token) or forced decode (replay; sglang)")
    p.add_argument("--identity", action="store_true",
                   help="compare every continued response with the same request's fault-free greedy ids")
    p.add_argument("--throughput", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="after the kills: greedy streams at once through the engine, e.g. 1,16")
    p.add_argument("--throughput-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--regen-repeats", type=int, default=None, help="runs per recovery mode (default: --repeats; 0 skips)")
    p.add_argument("--tag", default="", help="suffix of the result file names")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--regen-tokens", type=int, default=400)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--plot-only", default=None, help="re-draw the plot of an existing result JSON")
    args = p.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return
    args.regen_repeats = args.repeats if args.regen_repeats is None else args.regen_repeats
    if args.model_dir is None and args.device != "cpu":
        print("engine_handover: no --model-dir: the embedded model (a few layers, not a Qwen3 shape) is measured",
              file=sys.stderr, flush=True)
    _instrument_router()
    rng = random.Random(7)
    result = {"device": args.device, "backend": args.backend, "host": platform.node(), "cpus": os.cpu_count(), "chunk_tokens": args.chunk_tokens,
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
    result["regenerated"] = regenerated(args, rng)
    modes = list(result["runs"])
    summary = {m: {k: _stats([r[k] for r in result["runs"][m]]) for k in ("kill_to_first_token_s", "detection_s", "supervisor_handover_s", "routed_to_first_token_s")}
               for m in modes}
    for m in modes:
        keys = dict.fromkeys(k for r in result["runs"][m] for k, v in r["breakdown"].items() if isinstance(v, float))
        summary[m]["breakdown_mean"] = {k: _stats([r["breakdown"].get(k) for r in result["runs"][m]]).get("mean") for k in keys}
    if {"cold", "shadow"} <= set(modes):
        summary["speedup"] = summary["cold"]["kill_to_first_token_s"]["mean"] / summary["shadow"]["kill_to_first_token_s"]["mean"]
    if {"cold-disk", "shadow"} <= set(modes):
        summary["speedup_vs_cold_disk"] = (summary["cold-disk"]["kill_to_first_token_s"]["mean"]
                                           / summary["shadow"]["kill_to_first_token_s"]["mean"])
    summary["regenerated_mean"] = {k: statistics.fmean(v["regenerated"] for v in result["regenerated"][k])
                                   for k in ("token", "chunk") if result["regenerated"][k]}
    result["summary"] = summary
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.device.replace(":", "") + ("_sglang" if args.backend == "sglang" else "") + args.tag
    (out / f"engine_handover_{tag}.json").write_text(json.dumps(result, indent=2))
    try:
        if "speedup" in summary or "speedup_vs_cold_disk" in summary:
            plot(result, out / f"engine_handover_{tag}.png")
    except ImportError as exc:  # e.g. no matplotlib on the GPU machine: use --plot-only later
        print(f"no plot: {exc}")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
