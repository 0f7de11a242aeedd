"""GPU memory of one SGLang server on the arena's weights (a Belayer worker or shadow) under
the settings that size it: the CUDA per-thread stack limit, the prefill CUDA graphs, torch's
expandable segments and cuBLAS workspace, and the KV cache resident or released. All
variants run at once beside one arena on one GPU (each process's memory is its own in
``nvidia-smi``), then each answers the same greedy request, whose ids must equal the first
variant's, and times a 96-id prefill and a batched decode (16 x 64 tokens). For the KV-releasing
variants it also times ``/resume_memory_occupation`` and the 96-token prefill after it,
alone, without a killed server's context being torn down beside them. ``--probe`` adds
``_sglang_probe/`` to each server's path: its scheduler then reports its memory by phase
(context, built, flushed) and torch's allocations by the SGLang line that made them.

    bash benchmarks/sglang_gpu_env.sh python3 benchmarks/sglang_server_memory.py [--model-dir DIR]
        [--variants 'NAME;NAME' | --variants all] [--probe] [--one-at-a-time]
    python3 benchmarks/sglang_server_memory.py --plot-only results/sglang_server_memory_h200.json

Needs a CUDA GPU and SGLang (on the H200 image: the bundle, via sglang_gpu_env.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from _plotting import pyplot, save_result
from _procmem import gpu_by_process, gpu_mib, tree_gpu_mib

from belayer_engine.arena.client import ArenaClient
from belayer_engine.backends.sglang.launcher import (
    GPU_HOOKS_DIR,
    SGLangServerConfig,
    server_argv,
    server_env,
)


@dataclass(frozen=True)
class Variant:
    stack: int = 256  # CUDA per-thread stack bytes (0: the driver's 1 KiB)
    kv_released: bool = False  # KV cache released while idle (torch_memory_saver)
    prefill: int | None = 256  # prefill CUDA graphs up to this many tokens (None: off)
    expandable: bool = False  # torch's expandable segments (launcher's expandable_segments)
    args: tuple[str, ...] = ()  # further SGLang flags
    cublas: int = 0  # cuBLAS workspace MiB (0: torch's default, 32 on an H200; launcher's cublas_workspace_mib)


VARIANTS = {
    "resident, stack 1 KiB, prefill graphs 512": Variant(stack=0, prefill=512),
    "resident, stack 256, prefill graphs 512": Variant(prefill=512),
    "resident, stack 256, prefill graphs 256": Variant(),
    "resident, stack 1 KiB, prefill graphs 256": Variant(stack=0),
    "KV released, stack 256, prefill graphs 256": Variant(kv_released=True),
    "KV released, stack 1 KiB, prefill graphs 256": Variant(stack=0, kv_released=True),
    "resident, stack 256, prefill graphs 128": Variant(prefill=128),
    "resident, stack 256, prefill graphs off": Variant(prefill=None),
    "resident, stack 256, no CUDA graphs": Variant(prefill=None, args=("--disable-cuda-graph",)),
    "resident, stack 256, prefill graphs 256, decode graphs <= 4": Variant(args=("--cuda-graph-max-bs", "4")),
    "resident, stack 256, prefill graphs 256, expandable segments": Variant(expandable=True),
    "resident, stack 256, prefill graphs 128, expandable segments": Variant(prefill=128, expandable=True),
    "resident, stack 256, prefill graphs 64, expandable segments": Variant(prefill=64, expandable=True),
    "resident, stack 256, prefill graphs off, expandable segments": Variant(prefill=None, expandable=True),
    "KV released, stack 256, prefill graphs 128": Variant(kv_released=True, prefill=128),
    "resident, stack 256, prefill graphs 128, expandable segments, cuBLAS workspace 8 MiB":
        Variant(prefill=128, expandable=True, cublas=8),
    "resident, stack 256, prefill graphs 96, expandable segments": Variant(prefill=96, expandable=True),
    "resident, stack 256, prefill graphs 128, expandable segments, no overlap schedule":
        Variant(prefill=128, expandable=True, args=("--disable-overlap-schedule",)),
}
DEFAULT_VARIANTS = list(VARIANTS)[:6]
PROBE_DIR = Path(__file__).resolve().parent / "_sglang_probe"
PROMPT = [(7 * i) % 5000 + 11 for i in range(40)]


def post(url: str, body: dict | None = None, timeout: float = 120) -> dict | None:
    """JSON answer of a POST; None (printed) when the server fails it or is gone."""
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read()
        return json.loads(text) if text.strip().startswith((b"{", b"[")) else {}
    except (OSError, ValueError) as exc:
        print(f"POST {url} failed: {exc!r}", flush=True)
        return None


def get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError) as exc:
        print(f"GET {url} failed: {exc!r}", flush=True)
        return None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return round(time.perf_counter() - t0, 4)


def start_servers(model_dir: str, device: str, wcache: str, logs: Path, names: list[str],
                  probe: Path | None = None) -> dict:
    servers = {}
    for i, name in enumerate(names):
        v = VARIANTS[name]
        graphs = ["--cuda-graph-max-bs-prefill", str(v.prefill)] if v.prefill else ["--disable-prefill-cuda-graph"]
        cfg = SGLangServerConfig(model_path=model_dir, port=31000 + i, device=device, weight_cache_socket=wcache,
                                 memory_saver=v.kv_released, cuda_stack_bytes=v.stack,
                                 expandable_segments=v.expandable, cublas_workspace_mib=v.cublas,
                                 extra_args=graphs + list(v.args))
        env = server_env(cfg, base={k: x for k, x in os.environ.items()
                                     if k not in ("PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG")})
        if probe is not None:  # after gpu_hooks, whose sitecustomize runs the probe's
            (probe / str(i)).mkdir(parents=True, exist_ok=True)
            env["BELAYER_MEMORY_PROBE_DIR"] = str(probe / str(i))
            env["PYTHONPATH"] = _after_hooks(env.get("PYTHONPATH", ""), str(PROBE_DIR))
        log = open(logs / f"server-{i}.log", "w")  # noqa: SIM115 (open while the server runs)
        servers[name] = (f"http://127.0.0.1:{cfg.port}",
                         subprocess.Popen(server_argv(cfg), env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline, pending = time.time() + 600, set(servers)
    while pending and time.time() < deadline:
        for name in list(pending):
            url, proc = servers[name]
            if proc.poll() is not None or healthy(url):
                print(f"{name}: {'exited ' + str(proc.returncode) if proc.poll() is not None else 'healthy'}",
                      flush=True)
                pending.discard(name)
        time.sleep(2)
    return servers


def _after_hooks(pythonpath: str, entry: str) -> str:
    """``entry`` right after Belayer's gpu_hooks folder (first when there is none)."""
    parts = [p for p in pythonpath.split(":") if p]
    at = parts.index(str(GPU_HOOKS_DIR)) + 1 if str(GPU_HOOKS_DIR) in parts else 0
    return ":".join(parts[:at] + [entry] + parts[at:])


def probe_phases(probe: Path, index: int) -> list[dict]:
    """The probe's phase rows of server ``index`` (its scheduler's file), in order."""
    rows = []
    for path in sorted((probe / str(index)).glob("phases-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def measure(model_dir: str, device: str, names: list[str], probe: Path | None = None) -> dict:
    run = Path(tempfile.mkdtemp(prefix="sglang-memory-"))
    sock, wcache = str(run / "arena.sock"), str(run / "wcache.sock")
    arena = subprocess.Popen([sys.executable, "-m", "belayer_engine.backends.sglang.arena", "--socket", sock, "--device", device,
                              "--model-dir", model_dir, "--weight-cache-socket", wcache, "--no-reference-slots"])
    servers = {}
    try:
        ArenaClient(sock, timeout=120).wait_ready(timeout=600)
        servers = start_servers(model_dir, device, wcache, run, names, probe)
        for url, proc in servers.values():  # what a shadow's warm-up runs, then the arena's flush
            if proc.poll() is None:
                for n in (16, 256):
                    post(url + "/generate", {"input_ids": [1 + i % 200 for i in range(n)],
                                             "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                 "ignore_eos": True}})
                post(url + "/flush_cache")
        result = {"arena_gpu_mib": tree_gpu_mib(gpu_mib(), arena.pid), "variants": {}}
        for name, (url, proc) in servers.items():
            v = VARIANTS[name]
            alive = proc.poll() is None
            gpu = gpu_mib()
            row = {"cuda_stack_bytes": v.stack, "kv_released_while_idle": v.kv_released,
                   "prefill_graph_tokens": v.prefill, "expandable_segments": v.expandable, "args": list(v.args),
                   "cublas_workspace_mib": v.cublas,
                   "alive": alive,
                   "gpu_mib": tree_gpu_mib(gpu, proc.pid) if alive else None,
                   "gpu_mib_by_process": gpu_by_process(gpu, proc.pid) if alive else None}
            if probe is not None:
                row["probe"] = probe_phases(probe, names.index(name))
            answer = post(url + "/generate", {"input_ids": PROMPT, "sampling_params": {
                "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}) if row["alive"] else None
            row["greedy_ids"] = (answer or {}).get("output_ids")
            state = get_json(url + "/server_info") if row["alive"] else None
            # SGLang's own split (GB); its graph figures are exact only with one server at a time
            row["sglang_memory_usage"] = ((state or {}).get("internal_states") or [{}])[0].get("memory_usage")
            result["variants"][name] = row
        prefill_96 = {"input_ids": list(range(1, 97)), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        batch = {"input_ids": [[(13 * i + j) % 5000 + 11 for j in range(64)] for i in range(16)],
                 "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}
        for name, row in result["variants"].items():
            url, proc = servers[name]
            if not row["alive"]:
                continue
            if row["kv_released_while_idle"]:
                resume, prefill = [], []
                for k in range(6):
                    post(url + "/release_memory_occupation", {"tags": ["kv_cache"]})
                    if k == 0:
                        row["released_gpu_mib"] = tree_gpu_mib(gpu_mib(), proc.pid)
                    resume.append(timed(lambda u=url: post(u + "/resume_memory_occupation", {"tags": ["kv_cache"]})))
                    prefill.append(timed(lambda u=url: post(u + "/generate", prefill_96)))
                row["resume_s"], row["prefill_96_after_resume_s"] = resume, prefill
            row["prefill_96_s"] = [timed(lambda u=url: post(u + "/generate", prefill_96)) for _ in range(5)]
            # throughput: 16 greedy requests of 64 tokens decoded together (one batched /generate)
            row["batch_16x64_s"] = [timed(lambda u=url: post(u + "/generate", batch)) for _ in range(3)]
        return result
    finally:
        for _, proc in servers.values():
            proc.terminate()
        for _, proc in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        arena.terminate()
        arena.wait(60)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [(name, row) for name, row in result["variants"].items() if row.get("gpu_mib")]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.42 * len(rows)))
    ys = range(len(rows))
    ax.barh(list(ys), [row["gpu_mib"] for _, row in rows], color="#48c", label="serving (KV resident)")
    released = [(y, row["released_gpu_mib"]) for y, row in enumerate(r for _, r in rows) if row.get("released_gpu_mib")]
    if released:
        ax.barh([y for y, _ in released], [m for _, m in released], color="#c84", label="idle shadow, KV released")
    for y, (_, row) in enumerate(rows):
        ax.text(row["gpu_mib"] + 10, y, f"{row['gpu_mib']:,.0f}", va="center", fontsize=7)
    ax.axvline(1536, color="#333", linestyle="--", linewidth=1, label="1.5 GiB")
    ax.axvline(1.5e9 / 2**20, color="#933", linestyle=":", linewidth=1, label="1.5 GB")
    ax.set_yticks(list(ys), [name for name, _ in rows], fontsize=7)
    ax.set_xlabel("GPU MiB of one SGLang server on the arena's weights (nvidia-smi)")
    ax.set_title("SGLang 0.5.17, Qwen3-4B shape, 4,096-token KV, one H200", fontsize=9)
    ax.set_xlim(0, max(row["gpu_mib"] for _, row in rows) * 1.12)
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--model-dir", default=None, help="HF-layout model dir (default: the embedded Qwen3-4B shape)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sglang_server_memory_h200.json")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="one variant per arena and run (slower; SGLang's graph memory figures are then exact)")
    p.add_argument("--variants", default=";".join(DEFAULT_VARIANTS),
                   help='variant names separated by ";", or "all" (default: the first six: ' + "; ".join(DEFAULT_VARIANTS) + ')')
    p.add_argument("--probe", action="store_true",
                   help="record each scheduler's memory by phase and by allocating SGLang source line (_sglang_probe/)")
    p.add_argument("--plot-only", type=Path, default=None, help="re-draw the plot of an existing result JSON")
    args = p.parse_args()
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
        return
    model_dir = args.model_dir
    if model_dir is None:
        from belayer_engine.backends.sglang.model_dir import ensure_embedded_model
        from belayer_engine.model.config import ModelConfig

        model_dir = str(ensure_embedded_model(cfg=ModelConfig.qwen3_4b()))
    names = list(VARIANTS) if args.variants == "all" else [n.strip() for n in args.variants.split(";") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    probe = Path(tempfile.mkdtemp(prefix="sglang-probe-")) if args.probe else None
    groups = [[name] for name in names] if args.one_at_a_time else [names]
    runs = [measure(model_dir, args.device, group, probe and probe / str(k)) for k, group in enumerate(groups)]
    result = {"source": "bash benchmarks/sglang_gpu_env.sh python3 benchmarks/sglang_server_memory.py"
                        + (" --one-at-a-time" if args.one_at_a_time else "") + (" --probe" if args.probe else ""),
              "arena_gpu_mib": runs[0]["arena_gpu_mib"],
              "variants": {name: row for run in runs for name, row in run["variants"].items()}}
    first = next(iter(result["variants"].values()))["greedy_ids"]
    for row in result["variants"].values():  # across runs too: every variant against the first
        row["ids_equal_first_variant"] = bool(first) and row["greedy_ids"] == first
    save_result(result, args.out, plot)
    print(json.dumps({k: v for k, v in result.items() if k != "variants"}, indent=1))
    for name, row in result["variants"].items():
        print(name, {k: v for k, v in row.items() if k != "greedy_ids"})


if __name__ == "__main__":
    main()
