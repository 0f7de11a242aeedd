"""GPU memory of an SGLang-only arena (Qwen3-4B shape, seeded weights) with the driver's
per-thread stack limit vs ``--cuda-stack-bytes 256``, one after the other on one GPU, each
before and after a weight update (the embedding and one MLP matrix, 0.83 GB).

    python3 benchmarks/arena_gpu_memory.py [--device cuda:0]   # -> results/arena_gpu_memory_h200.{json,png}

Needs a CUDA GPU (and pydantic: on the H200 image, the SGLang bundle's PYTHONPATH).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _plotting import pyplot, save_result
from _procmem import gpu_mib

from belayer_engine.arena.client import ArenaClient


def measure(device: str, stack_bytes: int) -> dict:
    d = tempfile.mkdtemp()
    sock, wsock = f"{d}/a.sock", f"{d}/w.sock"
    proc = subprocess.Popen([sys.executable, "-m", "belayer_engine.backends.sglang.arena", "--socket", sock, "--device", device,
                             "--preset", "qwen3-4b", "--weight-cache-socket", wsock, "--no-reference-slots",
                             "--cuda-stack-bytes", str(stack_bytes)])
    try:
        client = ArenaClient(sock, timeout=120)
        t0 = time.time()
        client.wait_ready(timeout=300)
        ready = gpu_mib().get(proc.pid)
        version = client.update_weights({
            "model.embed_tokens.weight": torch.randn(151936, 2560, dtype=torch.bfloat16),
            "model.layers.0.mlp.gate_proj.weight": torch.randn(9728, 2560, dtype=torch.bfloat16)})
        return {"stack_bytes": stack_bytes, "ready_mib": ready, "after_update_mib": gpu_mib().get(proc.pid),
                "version": version, "health_ok": client.health()["device_ok"],
                "cuda_stack": client.describe()["cuda_stack"], "ready_s": round(time.time() - t0, 1)}
    finally:
        proc.terminate()
        proc.wait(60)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    runs = result["runs"]
    labels = [f"stack {r['stack_bytes'] or 'default'}" for r in runs]
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], [r["ready_mib"] for r in runs], 0.4, label="ready", color="#48c")
    ax.bar([x + 0.2 for x in xs], [r["after_update_mib"] for r in runs], 0.4, label="after a 0.83 GB update", color="#c84")
    ax.axhline(result["tensors_mib"], color="#333", linestyle="--", linewidth=1, label="the weights themselves")
    ax.set_xticks(list(xs), labels)
    ax.set_ylim(result["tensors_mib"] - 500, max(r["after_update_mib"] for r in runs) + 300)
    ax.set_ylabel("arena GPU MiB (nvidia-smi)")
    ax.set_title("SGLang-only arena, Qwen3-4B shape", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "arena_gpu_memory_h200.json")
    args = p.parse_args()
    runs = [measure(args.device, n) for n in (0, 256)]
    result = {"source": "python3 benchmarks/arena_gpu_memory.py", "tensors_mib": 7696, "runs": runs}
    save_result(result, args.out, plot)
    print(result)


if __name__ == "__main__":
    main()
