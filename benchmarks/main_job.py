"""Time lost in the main job with and without Belayer: the SWE agent RL demo under faults.

Runs the README's first command (``python3 -m belayer demo``: warm start + GRPO of the embedded
model on toy SWE repos in real sandboxes, while containers are killed and OOMed, the inference
worker is SIGKILLed and the learner is SIGKILLed during a checkpoint save) and keeps what it
measured: the demo's summary (reward by step, faults and recoveries, time lost with Belayer,
measured, and without it, estimated per fault class: docs/training.md says how) and every env
rollback from the step events (``rollbacks``: where each fault hit, the boundary restored,
the recovery's parts). Every option of ``belayer demo`` is accepted (``--steps``, ``--seed``,
``--faults-env-rate`` ...); the demo's own files stay in ``--out-dir``.

    python3 benchmarks/main_job.py                         # the defaults: 6.5-7 min on 2 quiet cores
    python3 benchmarks/main_job.py --steps 1 --tasks-per-step 1 --group-size 2 --out /tmp/mj.json
Writes benchmarks/results/main_job.json and main_job.png (the demo's plot); Docker + CRIU, root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from belayer.cli.demo import FLAGS  # noqa: E402 - after the path
from belayer.examples.swe_rl.run import run  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def _source(argv: list[str], seconds: float, load_start: tuple[float, ...]) -> dict:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return {"command": " ".join(["python3", "benchmarks/main_job.py", *argv]), "commit": commit or None,
            "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}",
            "gpu": shutil.which("nvidia-smi") is not None, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "wall_s": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS / "main_job.json"), help="the result JSON (+ .png beside it)")
    FLAGS.add_to(p)
    args = p.parse_args(argv)
    cfg = FLAGS.build(args)
    t0, load_start = time.monotonic(), os.getloadavg()  # the machine's load says what the wall time means
    summary = run(cfg, lambda line: print(line, file=sys.stderr, flush=True))
    events = Path(cfg.out_dir) / "events.jsonl"
    steps = [json.loads(line) for line in events.read_text().splitlines() if line.strip()] if events.is_file() else []
    rollbacks = [r for ev in steps if ev.get("event") == "step" for r in ev.get("rollbacks", [])]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = summary.pop("plot", None)
    result = {"source": _source(argv, time.monotonic() - t0, load_start), "summary": summary, "rollbacks": rollbacks}
    out.write_text(json.dumps(result, indent=1) + "\n")
    if plot and Path(plot).is_file():
        shutil.copyfile(plot, out.with_suffix(".png"))
    lost = summary.get("time_lost_s", {})
    print(json.dumps({"out": str(out), "env_faults": summary.get("env_faults"),
                      "env_recoveries": summary.get("env_recoveries"), "time_lost_s": lost}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
