"""What does a worker's start cost: a cold start, attaching to a live arena, a shadow's handover?

Cold start: a fresh process imports torch, inits the device, loads safetensors onto it,
allocates its KV, captures decode graphs (CUDA) and emits the first token. Attach: a fresh
process maps a live arena's weights and KV instead. Handover: a pre-initialized shadow
(arena mapped, graphs captured on scratch blocks) is activated and emits a first token.
The model: random weights of the Qwen3-4B shape in bf16 (``_random_model.py``), or the
embedded small model with ``--small``. Decode throughput: ``engine_decode.py``.

    python benchmarks/engine_coldstart.py --device cuda:0            # Qwen3-4B shape, bf16
    python benchmarks/engine_coldstart.py --device cpu --small       # quick, exercises all
Writes benchmarks/results/engine_coldstart-<device>.json and a .png plot (if matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

T_SPAWN = time.time()
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._plotting import pyplot, save_result  # noqa: E402
from benchmarks._random_model import prepared, sync  # noqa: E402


# --------------------------------------------------------------------- child processes
def child_cold(model_dir: str, device: str, num_blocks: int, block_size: int, t_spawn: float):
    marks = {}
    t0 = time.time()
    import torch

    marks["import_torch_s"] = time.time() - t0
    from belayer_engine.backends.reference.graphs import GraphRunner
    from belayer_engine.backends.reference.model import Qwen3Model, SeqBatch
    from belayer_engine.model.config import ModelConfig, kv_shape
    from belayer_engine.model.weights import load_safetensors_dir, torch_dtype

    t = time.time()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.init()
        torch.zeros(1, device=dev)
    marks["device_init_s"] = time.time() - t
    t = time.time()
    cfg = ModelConfig.from_dir(model_dir)
    w = {k: v.to(dev) for k, v in load_safetensors_dir(model_dir, cfg).items()}
    sync(dev)
    marks["load_weights_s"] = time.time() - t
    t = time.time()
    kv = torch.zeros(kv_shape(cfg, num_blocks + 1, block_size), dtype=torch_dtype(cfg.dtype),
                     device=dev)
    model = Qwen3Model(cfg, w, exact=dev.type == "cpu", device=dev)
    sync(dev)
    marks["alloc_kv_s"] = time.time() - t
    t = time.time()
    if dev.type == "cuda":
        GraphRunner(model, kv, 2048 // block_size, num_blocks).capture()
    marks["graphs_s"] = time.time() - t
    t = time.time()
    prompt = list(range(1, 17))
    logits = model.forward(torch.tensor(prompt), torch.arange(16), [SeqBatch(0, 16, 16, [0])], kv)
    int(logits[0].argmax())
    marks["first_token_s"] = time.time() - t
    marks["total_s"] = time.time() - t_spawn
    return marks


def child_attach(socket: str, t_spawn: float):
    """A fresh process attaches to the live arena (cold process, warm memory)."""
    marks = {}
    t0 = time.time()
    import torch  # noqa: F401

    marks["import_torch_s"] = time.time() - t0
    from belayer_engine.backends.reference.state import WorkerState

    t = time.time()
    rt = WorkerState(socket, "bench-attach", shadow=True)
    marks["attach_and_graphs_s"] = time.time() - t
    marks.update(_activate_first_token(rt))
    marks["total_s"] = time.time() - t_spawn
    return marks


def child_shadow(socket: str, t_spawn: float):
    """Pre-initialized shadow: only activation + first token are on the critical path."""
    from belayer_engine.backends.reference.state import WorkerState

    rt = WorkerState(socket, "bench-shadow", shadow=True)
    return {"shadow_init_s": time.time() - t_spawn, **_activate_first_token(rt)}


def _activate_first_token(rt) -> dict:
    import threading

    from belayer_engine.backends.reference.sampling import SamplingParams
    from belayer_engine.backends.reference.scheduler import Request

    t = time.time()
    rt.activate()
    marks = {"activate_s": time.time() - t}
    done = threading.Event()
    rt.scheduler.submit(Request("b", list(range(1, 17)), SamplingParams(max_new_tokens=1,
                     temperature=0.0), lambda ev: ev["finish_reason"] and done.set()))
    done.wait(120)
    marks["handover_first_token_s"] = time.time() - t
    rt.close()
    return marks


# --------------------------------------------------------------------- driver
def run_child(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.time()
    out = subprocess.run([sys.executable, __file__, "--child", *args, "--t-spawn", str(t)],
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_arena(model_dir: str, device: str, sock: str, num_blocks: int, block_size: int):
    from belayer_engine.arena.client import ArenaClient

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "belayer_engine.arena", "--socket", sock,
                             "--device", device, "--model-dir", model_dir, "--num-blocks",
                             str(num_blocks), "--block-size", str(block_size)], env=env)
    ArenaClient(sock).wait_ready(600)
    return proc


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 4))
    names = ["cold start", "attach (fresh process)", "shadow handover"]
    vals = [result["cold"]["total_s"], result["attach"]["total_s"],
            result["shadow"]["handover_first_token_s"]]
    ax.bar(names, vals, color=["#c44", "#e93", "#3a6"])
    ax.set_ylabel("seconds to first token")
    ax.set_title(f"worker start ({result['device']}, {result['model']})")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.3g}s", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--small", action="store_true", help="embedded small model (CPU smoke run)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--workdir", default=None, help="where the random model dir is written")
    p.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    p.add_argument("--t-spawn", type=float, default=T_SPAWN, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, rest = a.child[0], a.child[1:]
        if kind == "cold":
            res = child_cold(rest[0], rest[1], int(rest[2]), int(rest[3]), a.t_spawn)
        elif kind == "attach":
            res = child_attach(rest[0], a.t_spawn)
        else:
            res = child_shadow(rest[0], a.t_spawn)
        print(json.dumps(res), flush=True)
        return 0

    small = a.small
    num_blocks = a.num_blocks or (256 if small else 4096)
    block_size = 16
    model_dir = prepared(a.workdir, small, a.device)
    result = {"device": a.device, "model": "small" if small else "qwen3-4b-shape-bf16"}
    result["cold"] = run_child(["cold", str(model_dir), a.device, str(num_blocks), str(block_size)])
    print("cold", result["cold"], flush=True)
    sock = str(model_dir.parent / "arena.sock")
    arena = start_arena(str(model_dir), a.device, sock, num_blocks, block_size)
    try:
        result["attach"] = run_child(["attach", sock])
        print("attach", result["attach"], flush=True)
        result["shadow"] = run_child(["shadow", sock])
        print("shadow", result["shadow"], flush=True)
    finally:
        arena.terminate()
        arena.wait(60)
    stem = f"engine_coldstart-{a.device.replace(':', '')}{'-small' if small else ''}"
    save_result(result, Path(a.out) / f"{stem}.json", plot)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
