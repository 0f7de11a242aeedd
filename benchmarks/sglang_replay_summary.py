"""Replay vs re-prefill after a SIGKILL, in SGLang's deterministic mode, on the GPU.

Reads the two ``engine_handover.py`` results of one GPU machine, run one after the other at
the same kill points (its seeded ``--repeats 3``), with
``--worker-arg=--enable-deterministic-inference --identity --max-tokens 160``:
``--recovery token`` (tag ``_h200_det_token``: the shadow re-prefills prompt + generated)
and ``--recovery replay`` (tag ``_h200_det_replay``: it decodes the generated ids again,
forced). Writes what each gives (is the response the fault-free greedy run's?) and costs
(kill -> next id at the client) to ``results/sglang_replay_h200.{json,png}``:

    python3 benchmarks/sglang_replay_summary.py [--results DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _plotting import pyplot, save_result

RECOVERIES = {"token": "re-prefill (recovery=token)", "replay": "replay (recovery=replay)"}


def summarise(results: Path) -> dict:
    out = {"source": "one H200, SGLang 0.5.17 bundle, Qwen3-4B shape (random bf16), "
                     "--enable-deterministic-inference (triton attention), 160 greedy ids per request, "
                     "3 SIGKILLs per recovery at the same points; 2026-12-03",
           "inputs": {}, "kills": {}}
    for name in RECOVERIES:
        path = results / f"engine_handover_cuda0_sglang_h200_det_{name}.json"
        raw = json.loads(path.read_text())
        out["inputs"][name] = path.name
        out["kills"][name] = [{"at_id": r["failure_at_token"], "kill_to_next_id_ms": round(r["kill_to_first_token_s"] * 1e3, 1),
                               "identical": r["identical"], "first_differing_id": r["first_mismatch"],
                               "replayed": r["replayed_tokens"], "reprefilled": r["reprefilled_tokens"]}
                              for r in raw["runs"]["shadow"]]
    out["summary"] = {name: {"identical": f"{sum(k['identical'] for k in kills)}/{len(kills)}",
                             "kill_to_next_id_ms": sorted(k["kill_to_next_id_ms"] for k in kills),
                             "ms_per_replayed_id": round(sum(k["kill_to_next_id_ms"] for k in kills)
                                                         / sum(k["at_id"] for k in kills), 1) if name == "replay" else None}
                      for name, kills in out["kills"].items()}
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"token": "#c84", "replay": "#48c"}
    for name, kills in result["kills"].items():
        a.scatter([k["at_id"] for k in kills], [k["kill_to_next_id_ms"] for k in kills], color=colors[name],
                  label=RECOVERIES[name])
        b.scatter([k["at_id"] for k in kills], [k["first_differing_id"] or 160 for k in kills], color=colors[name],
                  marker="o" if name == "replay" else "x", label=RECOVERIES[name])
    a.set_yscale("log")
    a.set_xlabel("ids generated before the kill")
    a.set_ylabel("kill -> next id at the client, ms")
    a.set_title("what recovery costs", fontsize=9)
    a.legend(fontsize=7)
    b.axhline(160, color="#333", linestyle="--", linewidth=1)
    b.set_ylim(0, 170)
    b.set_xlabel("ids generated before the kill")
    b.set_ylabel("first id differing from the fault-free run\n(160 = the whole response identical)")
    b.set_title("what recovery gives (deterministic mode)", fontsize=9)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    result = summarise(args.results)
    save_result(result, args.results / "sglang_replay_h200.json", plot)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
