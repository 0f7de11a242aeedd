"""GPU memory of one SGLang server on the arena's weights (a Belayer worker or shadow) under
the settings that size it: the CUDA per-thread stack limit, the prefill CUDA graphs, and the
KV cache resident or released. All variants run at once beside one arena on one GPU (each
process's memory is its own in ``nvidia-smi``), then each answers the same greedy request,
whose ids must equal the first variant's (the driver's defaults). For the KV-releasing
variants it also times ``/resume_memory_occupation`` and the 96-token prefill after it,
alone, without a killed server's context being torn down beside them.

    bash benchmarks/sglang_gpu_env.sh python3 benchmarks/sglang_server_memory.py [--model-dir DIR]
    python3 benchmarks/sglang_server_memory.py --plot-only results/sglang_server_memory_h200.json

Needs a CUDA GPU and SGLang (on the H200 image: the bundle, via sglang_gpu_env.sh).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _plotting import pyplot, save_result
from _procmem import gpu_mib, tree_gpu_mib

from belayer_engine.arena.client import ArenaClient
from belayer_engine.backends.sglang.launcher import SGLangServerConfig, server_argv, server_env

VARIANTS = {  # name -> (CUDA stack bytes (0: the driver's 1 KiB), KV released while idle, prefill graph tokens)
    "resident, stack 1 KiB, prefill graphs 512": (0, False, 512),
    "resident, stack 256, prefill graphs 512": (256, False, 512),
    "resident, stack 256, prefill graphs 256": (256, False, 256),
    "resident, stack 1 KiB, prefill graphs 256": (0, False, 256),
    "KV released, stack 256, prefill graphs 256": (256, True, 256),
    "KV released, stack 1 KiB, prefill graphs 256": (0, True, 256),
}
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


def start_servers(model_dir: str, device: str, wcache: str, logs: Path, names: list[str]) -> dict:
    servers = {}
    for i, name in enumerate(names):
        stack, saver, prefill = VARIANTS[name]
        cfg = SGLangServerConfig(model_path=model_dir, port=31000 + i, device=device, weight_cache_socket=wcache,
                                 memory_saver=saver, cuda_stack_bytes=stack,
                                 extra_args=["--cuda-graph-max-bs-prefill", str(prefill)])
        log = open(logs / f"server-{i}.log", "w")  # noqa: SIM115 (open while the server runs)
        servers[name] = (f"http://127.0.0.1:{cfg.port}",
                         subprocess.Popen(server_argv(cfg), env=server_env(cfg), stdout=log, stderr=subprocess.STDOUT))
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


def measure(model_dir: str, device: str, names: list[str]) -> dict:
    run = Path(tempfile.mkdtemp(prefix="sglang-memory-"))
    sock, wcache = str(run / "arena.sock"), str(run / "wcache.sock")
    arena = subprocess.Popen([sys.executable, "-m", "belayer_engine.arena", "--socket", sock, "--device", device,
                              "--model-dir", model_dir, "--weight-cache-socket", wcache, "--no-reference-slots"])
    servers = {}
    try:
        ArenaClient(sock, timeout=120).wait_ready(timeout=600)
        servers = start_servers(model_dir, device, wcache, run, names)
        for url, proc in servers.values():  # what a shadow's warm-up runs, then the arena's flush
            if proc.poll() is None:
                for n in (16, 256):
                    post(url + "/generate", {"input_ids": [1 + i % 200 for i in range(n)],
                                             "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                 "ignore_eos": True}})
                post(url + "/flush_cache")
        result = {"arena_gpu_mib": tree_gpu_mib(gpu_mib(), arena.pid), "variants": {}}
        for name, (url, proc) in servers.items():
            stack, saver, prefill = VARIANTS[name]
            row = {"cuda_stack_bytes": stack, "kv_released_while_idle": saver, "prefill_graph_tokens": prefill,
                   "alive": proc.poll() is None, "gpu_mib": tree_gpu_mib(gpu_mib(), proc.pid) if proc.poll() is None else None}
            answer = post(url + "/generate", {"input_ids": PROMPT, "sampling_params": {
                "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}) if row["alive"] else None
            row["greedy_ids"] = (answer or {}).get("output_ids")
            state = get_json(url + "/server_info") if row["alive"] else None
            # SGLang's own split (GB); its graph figures are exact only with one server at a time
            row["sglang_memory_usage"] = ((state or {}).get("internal_states") or [{}])[0].get("memory_usage")
            result["variants"][name] = row
        prefill_96 = {"input_ids": list(range(1, 97)), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
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
    fig, ax = plt.subplots(figsize=(7, 4))
    ys = range(len(rows))
    ax.barh(list(ys), [row["gpu_mib"] for _, row in rows], color="#48c", label="serving (KV resident)")
    released = [(y, row["released_gpu_mib"]) for y, row in enumerate(r for _, r in rows) if row.get("released_gpu_mib")]
    if released:
        ax.barh([y for y, _ in released], [m for _, m in released], color="#c84", label="idle shadow, KV released")
    for y, (_, row) in enumerate(rows):
        ax.text(row["gpu_mib"] + 10, y, f"{row['gpu_mib']:,.0f}", va="center", fontsize=7)
    ax.axvline(1536, color="#333", linestyle="--", linewidth=1, label="1.5 GiB")
    ax.set_yticks(list(ys), [name for name, _ in rows], fontsize=7)
    ax.set_xlabel("GPU MiB of one SGLang server on the arena's weights (nvidia-smi)")
    ax.set_title("SGLang 0.5.17, Qwen3-4B shape, 4,096-token KV, one H200", fontsize=9)
    ax.set_xlim(0, max(row["gpu_mib"] for _, row in rows) * 1.12)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.4, -0.16), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--model-dir", default=None, help="HF-layout model dir (default: the embedded Qwen3-4B shape)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sglang_server_memory_h200.json")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="one variant per arena and run (slower; SGLang's graph memory figures are then exact)")
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
    groups = [[name] for name in VARIANTS] if args.one_at_a_time else [list(VARIANTS)]
    runs = [measure(model_dir, args.device, names) for names in groups]
    result = {"source": "bash benchmarks/sglang_gpu_env.sh python3 benchmarks/sglang_server_memory.py"
                        + (" --one-at-a-time" if args.one_at_a_time else ""),
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
