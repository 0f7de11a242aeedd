"""Memory of an SGLang shadow on the arena's weights vs an SGLang server with its own copy.

Starts an arena that serves SGLang's weight-cache protocol, one SGLang server mapping its
weights (what a Belayer worker or shadow is) and one SGLang server that loads the same
checkpoint from disk (a second copy), runs one greedy request on each (so the weight
pages are touched) and reads ``/proc/<pid>/smaps_rollup`` of every process of each
server: RSS counts shared pages in every process that touched them, PSS splits them
among the sharers, "private" is memory no other process shares. Writes
``benchmarks/results/sglang_shadow_memory_cpu.json`` and its plot (``.png``).

    python benchmarks/sglang_shadow_memory.py                  # CPU, a ~0.6 GB fp32 model
    python benchmarks/sglang_shadow_memory.py --layers 4 --hidden 256 --vocab 512
    python benchmarks/sglang_shadow_memory.py --replot         # only redraw the plot of the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _procmem as procmem  # noqa: E402 - benchmarks/, on sys.path when run as a script
from _plotting import pyplot, save_result  # noqa: E402

from belayer_engine.arena.client import ArenaClient  # noqa: E402
from belayer_engine.backends.sglang.launcher import SGLangServerConfig, server_argv, server_env  # noqa: E402
from belayer_engine.backends.sglang.model_dir import embedded_config, ensure_embedded_model  # noqa: E402
from belayer_engine.common.net import free_port  # noqa: E402


def server_memory(pid: int) -> dict:
    n, total = procmem.tree_mib(pid)
    return {"processes": n, **total}


def generate(port: int) -> list[int]:
    body = {"input_ids": list(range(1, 33)), "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)["output_ids"]


def wait_health(port: int, proc: subprocess.Popen, timeout: float, spawned: float) -> float:
    """Seconds from spawn to the first 200 on /health."""
    while time.monotonic() - spawned < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server on port {port} exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - spawned
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server on port {port} not healthy after {timeout}s")


def plot(result: dict, path: Path) -> None:
    """RSS, PSS and private MiB of each server (and the arena) side by side."""
    plt = pyplot()
    if plt is None:
        return
    mem = result["memory_mib"]
    names = {"weight_cache_client": "SGLang on the arena's weights\n(a Belayer worker or shadow)",
             "own_copy": "SGLang with its own copy", "arena": "the arena"}
    fields, w = ("rss", "pss", "private"), 0.26
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for j, field in enumerate(fields):
        xs = [k + j * w for k in range(len(names))]
        ax.bar(xs, [mem[n][field] for n in names], width=w, label=field.upper() if field != "private" else "private")
    ax.set_xticks([k + w for k in range(len(names))], list(names.values()), fontsize=8)
    ax.set_ylabel("MiB (summed over each server's processes)")
    ax.set_title(f"{result['model']['weights_mib']:.0f} MiB of weights: the shadow's private memory is "
                 f"{result['own_copy_minus_client_private_mib']:.0f} MiB lower", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--replot", action="store_true", help="only redraw the plot of the JSON in --out")
    args = p.parse_args()
    if args.replot:
        path = Path(args.out) / "sglang_shadow_memory_cpu.json"
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return
    cfg = embedded_config(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                          num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                          head_dim=64, vocab_size=args.vocab)
    model = ensure_embedded_model(cfg=cfg)
    run = Path(tempfile.mkdtemp(prefix="belayer-sgl-mem-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen] = []
    try:
        arena = subprocess.Popen([sys.executable, "-m", "belayer_engine.backends.sglang.arena", "--socket", str(run / "arena.sock"),
                                  "--model-dir", str(model), "--weight-cache-socket", str(run / "wc.sock"),
                                  "--num-blocks", "1", "--scratch-blocks", "1"], env=env, start_new_session=True)
        procs.append(arena)
        ArenaClient(str(run / "arena.sock")).wait_ready(600)
        ports = {"weight_cache_client": free_port(), "own_copy": free_port()}
        servers, spawned = {}, {}
        for name, port in ports.items():
            scfg = SGLangServerConfig(model_path=str(model), port=port,
                                      weight_cache_socket=str(run / "wc.sock") if name == "weight_cache_client" else None)
            log = open(run / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
            spawned[name] = time.monotonic()
            servers[name] = subprocess.Popen(server_argv(scfg), env=server_env(scfg), stdout=log, stderr=log,
                                             start_new_session=True)
            procs.append(servers[name])
        ready = {name: wait_health(port, servers[name], 900, spawned[name]) for name, port in ports.items()}
        outputs = {name: generate(port) for name, port in ports.items()}
        weights_mib = ArenaClient(str(run / "arena.sock")).describe()["weight_cache"]["nbytes"] / 2**20
        result = {
            "device": "cpu", "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab,
                                       "dtype": cfg.dtype, "weights_mib": round(weights_mib, 1)},
            "ready_s": {k: round(v, 1) for k, v in ready.items()},
            "same_greedy_output": outputs["weight_cache_client"] == outputs["own_copy"],
            "memory_mib": {"arena": server_memory(arena.pid),
                           **{name: server_memory(proc.pid) for name, proc in servers.items()}},
        }
        mem = result["memory_mib"]
        result["own_copy_minus_client_private_mib"] = round(mem["own_copy"]["private"] - mem["weight_cache_client"]["private"], 1)
        save_result(result, Path(args.out) / "sglang_shadow_memory_cpu.json", plot)
        print(json.dumps(result, indent=2))
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    main()
