"""One table of the SGLang engine's GPU limits, from the raw outputs of ``engine_handover.py``.

Answers: how much GPU memory does the engine take next to a plain SGLang server at the
same KV size (arena + worker + idle shadow), what does each shadow mode cost and give at a
handover, and what does SGLang's deterministic inference mode cost and give. Inputs are
the JSONs ``engine_handover.py --backend sglang --device cuda:0`` wrote on the GPU machine
(tags below) and the log of ``test_sglang_gpu_deterministic.py``:

    python3 benchmarks/sglang_gpu_summary.py RAW_DIR   # -> results/sglang_gpu_limits_h200.{json,png}
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

RUNS = {  # tag -> what it is
    "4b": "shadow: KV + graphs released, no prefill graphs (the earlier default)",
    "4b_saver": "shadow: KV released, graphs resident, prefill graphs <= 512 tokens (default)",
    "4b_resident": "shadow: nothing released (sglang_shadow_memory_saver=False), prefill graphs <= 512",
    "4b_det": "SGLang --enable-deterministic-inference (no kills; throughput)",
    "4b_disk": "plain SGLang server from disk, same KV size (4,096 tokens)",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    raw = {t: json.loads((args.raw / f"engine_handover_cuda0_sglang_h200_{t}.json").read_text()) for t in RUNS}
    plain = raw["4b_disk"]["runs"]["cold-disk"][0]["plain_server_gpu_mib"]
    memory = {t: raw[t]["shadow"]["memory"] for t in ("4b", "4b_saver", "4b_resident")}
    handover = {t: raw[t]["summary"]["shadow"]["kill_to_first_token_s"] for t in ("4b", "4b_saver", "4b_resident")}
    det_log = (args.raw / "E_det_test.log").read_text()
    m = re.search(r"kill at (\d+): first differing id at (\d+) of (\d+)", det_log)
    result = {
        "source": "one H200, SGLang 0.5.17 bundle, Qwen3-4B shape (random bf16), engine defaults "
                  "(max_total_tokens 4096, 16 running requests); 2026-12-03",
        "runs": RUNS,
        "memory_mib": {t: {k: memory[t][k] for k in ("arena_gpu_mib", "worker_gpu_mib", "shadow_gpu_mib",
                                                     "engine_gpu_mib")} for t in memory},
        "plain_server_gpu_mib": plain,
        "engine_minus_plain_mib": {t: memory[t]["engine_gpu_mib"] - plain for t in memory},
        "kill_to_next_token_s": handover,
        "throughput_tokens_per_s": {"default": raw["4b"]["shadow"]["throughput"],
                                    "deterministic": raw["4b_det"]["shadow"]["throughput"]},
        "deterministic_continuation": {
            "test": "tests/belayer_engine/backends/sglang/test_sglang_gpu_deterministic.py",
            "identical": m is None and "passed" in det_log,
            "kill_at": int(m.group(1)) if m else None, "first_differing_id": int(m.group(2)) if m else None,
            "of": int(m.group(3)) if m else None},
        "default_mode_first_mismatch": [r.get("first_mismatch") for r in raw["4b"]["runs"]["shadow"]],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sglang_gpu_limits_h200.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    plot(result, args.out / "sglang_gpu_limits_h200.png")


def plot(result: dict, path: Path) -> None:
    from _plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    names = {"4b": "KV+graphs\nreleased", "4b_saver": "KV released\n(default)", "4b_resident": "resident"}
    mem = result["memory_mib"]
    labels = ["plain SGLang\n(no shadow)"] + [names[t] for t in mem]
    bottoms = [0] * len(labels)
    for part, color in (("arena_gpu_mib", "#888"), ("worker_gpu_mib", "#48c"), ("shadow_gpu_mib", "#4a4")):
        vals = [0] + [mem[t][part] for t in mem]
        a.bar(labels, vals, bottom=bottoms, color=color, label=part.split("_")[0])
        bottoms = [x + y for x, y in zip(bottoms, vals, strict=True)]
    a.bar(labels[:1], [result["plain_server_gpu_mib"]], color="#822", label="plain server")
    a.set_ylabel("GPU MiB")
    a.set_title("engine GPU memory (4B, KV 4,096 tokens)", fontsize=9)
    a.legend(fontsize=7)
    ho = result["kill_to_next_token_s"]
    b.bar([names[t] for t in ho], [ho[t]["p50"] * 1000 for t in ho], color=["#c84", "#4a4", "#48c"])
    b.axhline(50, color="#333", linestyle="--", linewidth=1)
    b.set_ylabel("kill -> next token at the client, ms (p50 of 3)")
    b.set_title("handover by shadow mode", fontsize=9)
    tp = result["throughput_tokens_per_s"]
    batches = [x["batch"] for x in tp["default"]]
    width = 0.35
    xs = range(len(batches))
    c.bar([x - width / 2 for x in xs], [x["tokens_per_s"] for x in tp["default"]], width, label="default", color="#48c")
    c.bar([x + width / 2 for x in xs], [x["tokens_per_s"] for x in tp["deterministic"]], width,
          label="--enable-deterministic-inference", color="#c84")
    c.set_xticks(list(xs), [f"batch {n}" for n in batches])
    c.set_ylabel("generated tokens/s (through the engine)")
    c.set_title("deterministic mode's throughput cost", fontsize=9)
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
