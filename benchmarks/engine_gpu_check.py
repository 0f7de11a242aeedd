"""Smoke check of the CUDA paths (run on a GPU machine; CI has none).

Starts an arena on cuda:0 (small model, float32), attaches a worker runtime (CUDA IPC
mapping, decode graphs), and checks: greedy tokens of the graph path equal the eager path
and the dense reference; a weight update pushed as CUDA IPC handles changes the version;
a shadow activates after the first worker is closed. Prints one JSON line per check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def generate(rt, prompt, n):
    from belayer_engine.backends.reference.sampling import SamplingParams
    from belayer_engine.backends.reference.scheduler import Request

    done, out = threading.Event(), {}

    def emit(ev):
        if ev["finish_reason"] is not None:
            out.update(ev)
            done.set()

    rt.scheduler.submit(Request(f"r{time.time()}", prompt,
                             SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                             emit))
    assert done.wait(120), "generation timed out"
    return out["output_ids"], out["weight_version"]


def main() -> int:
    import torch

    from belayer_engine.arena.client import ArenaClient
    from belayer_engine.backends.reference.dense import greedy_generate
    from belayer_engine.backends.reference.state import WorkerState
    from belayer_engine.model.config import ModelConfig
    from belayer_engine.model.weights import init_weights

    torch.backends.cuda.matmul.allow_tf32 = False
    sock = os.path.join(tempfile.mkdtemp(), "arena.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    arena = subprocess.Popen([sys.executable, "-m", "belayer_engine.arena", "--socket", sock,
                              "--device", "cuda:0"], env=env)
    try:
        client = ArenaClient(sock)
        client.wait_ready(300)
        print(json.dumps({"health": client.health()}), flush=True)
        rt = WorkerState(sock, "gpu-check", shadow=False)
        cfg, w = ModelConfig(), init_weights(ModelConfig(), 0)
        prompts = [[1, 2, 3, 4, 5], [258, 117, 115, 101, 114, 10, 104, 105], [42] * 20]
        got = [generate(rt, p, 24)[0] for p in prompts]
        ref = [greedy_generate(cfg, w, p, 24, exact=False) for p in prompts]
        graphs_used = rt.scheduler.graphs is not None
        print(json.dumps({"check": "graph_vs_reference", "graphs": graphs_used,
                          "equal": got == ref, "got": got, "ref": ref}), flush=True)
        rt.scheduler.graphs = None
        eager = [generate(rt, p, 24)[0] for p in prompts]
        print(json.dumps({"check": "eager_vs_reference", "equal": eager == ref}), flush=True)
        new = {k: v.cuda() for k, v in init_weights(cfg, 1).items()}
        v = client.update_weights(new)
        toks, ver = generate(rt, prompts[0], 24)
        ref1 = greedy_generate(cfg, init_weights(cfg, 1), prompts[0], 24, exact=False)
        print(json.dumps({"check": "ipc_update", "version": v, "served": ver,
                          "equal": toks == ref1}), flush=True)
        shadow = WorkerState(sock, "gpu-shadow", shadow=True)
        rt.close()
        t = time.time()
        for _ in range(100):
            try:
                took = shadow.activate()
                break
            except Exception:  # the old connection may take a moment to close
                time.sleep(0.05)
        toks, ver = generate(shadow, prompts[0], 24)
        print(json.dumps({"check": "shadow_activate", "activate_s": took,
                          "wall_s": time.time() - t, "equal": toks == ref1}), flush=True)
        print(json.dumps({"checksums": client.checksums()}), flush=True)
    finally:
        arena.terminate()
        arena.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
