"""What the four checkpoint benchmarks share (``capture_bench``, ``restore_bench``,
``standby_bench``, ``fork_bench``): the sandboxes they measure, the rounds' rhythm, the
result's frame, its summary, plot and printout.

Scenarios: ``idle``, a fresh shell container; ``heavy``, a python process holding a 50 MiB
heap (random bytes, so every page is real) plus a git repo of ~2,000 files with ~20 MiB of
changes in the writable layer. Each round starts with an agent-like step (``STEP``: a few
small files written) so there is something to capture, and the methods of a question are
interleaved in every round, their order alternating or rotating by round.

Every timed call starts once the previous one's background work has finished (``settle``:
a fenced container's removal, a restore's spent copies and the write-back of what a
prestage or a restore wrote go on threads, off the critical path; a heavy container's
removal takes seconds and would otherwise land in the next call).

The machine may be shared: the load average is recorded at the start and after every
round (``host.loadavg``); under load compare the methods side by side (same run,
interleaved), not with figures from another machine.

Each benchmark runs again and again on one machine: every name it creates (containers,
Docker checkpoints, images) carries a run id, every checkpoint copy it restores from
carries a nonce file (Docker uploads the directory to containerd's content store by
digest: two identical copies, or one a crashed run left there, collide with "content ...
already exists"), and it removes what it made, containerd's unpacked copies of the
checkpoints included (``belayer_env.restore.ctrd_copies``). All need Docker + CRIU, root.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from belayer_env.restore.cleanup import wait_cleaned
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.docker_api import connect
from belayer_env.sandbox.fence import fence
from belayer_env.sandbox.removal import wait_removed
from belayer_env.sandbox.writeback import wait_flushed
from belayer_env.store.store import CheckpointStore, owner_tag
from benchmarks._plotting import pyplot, save_result

ROOT = Path(__file__).resolve().parents[1]
HEAVY_SETUP = r"""
set -e
mkdir -p /repo && cd /repo && git init -q . && git config user.email b@b && git config user.name b
python3 - <<'PY'
import os, base64
for i in range(2000):
    d = f"pkg{i % 40}"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/mod{i}.py", "w") as f:   # ~10 KiB of text per file: ~20 MiB in all
        f.write(base64.b64encode(os.urandom(7600)).decode())
PY
git add -A && git commit -qm init
setsid python3 -c 'import os, time; heap = bytearray(os.urandom(50 << 20)); open("/tmp/ready", "w").close(); time.sleep(1e9)' >/dev/null 2>&1 </dev/null &
for i in $(seq 100); do [ -e /tmp/ready ] && exit 0; sleep 0.1; done; exit 1
"""
STEP = "mkdir -p /work/steps && for i in 1 2 3 4 5; do echo {i} >> /work/steps/log$i; done && echo {i} > /work/steps/last"
"""An agent-like step before every capture: a few small files appended to or rewritten."""
WAIT_S = 300.0
"""Bound of the wait for work prepared ahead (a standby, warm forks)."""
GREY = ("docker", "cold", "floors")
"""Docker's own paths, the cold start and the floors: the baselines, grey in the plots."""


def settle() -> None:
    """Before each timed call: the previous one's work moved off its critical path (a fenced
    container's removal, seconds for a heavy layer; spent copies) has finished, so it does not
    land in this one's time (in an agent loop rollbacks are seconds apart)."""
    assert wait_cleaned() and wait_removed() and wait_flushed(), "background work of the previous call did not finish"


def bench_sandbox(client, scenario: str, run_id: str) -> DockerSandbox:
    """A fresh sandbox of ``scenario`` (``heavy``: its heap and repo set up), named for this run."""
    sb = DockerSandbox(client=client, timeout=120, name_prefix=f"belayer-bench-{run_id}")
    if scenario == "heavy":
        r = sb.execute(HEAVY_SETUP)
        assert r["returncode"] == 0, r["output"][-2000:]
    return sb


def fence_run(client, run_id: str) -> None:
    """Fence every container this run made (their names carry its id)."""
    for c in client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"}):
        fence(client, c["Names"][0].lstrip("/"), background=False)


def summarize(samples: list[float]) -> dict:
    s = sorted(samples)
    pct = lambda q: s[min(len(s) - 1, round(q * (len(s) - 1)))]  # noqa: E731
    return {"p50": statistics.median(s), "p90": pct(0.90), "p95": pct(0.95), "min": s[0], "max": s[-1],
            "n": len(s)}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


@dataclass
class Run:
    """What one scenario's measurement gets: the Docker client, the store, this run's id, the
    number of rounds, the load average list to append to after each round, the arguments."""

    client: object
    scenario: str
    runs: int
    store: CheckpointStore
    run_id: str
    loads: list
    args: argparse.Namespace

    def round_done(self) -> float:
        self.loads.append(os.getloadavg())
        return self.loads[-1][0]


@dataclass
class Question:
    """One benchmark: its name (script and result file), the methods it measures and how."""

    name: str
    doc: str
    measure: Callable[[Run], dict]
    """One scenario's raw samples: method -> figure -> list of seconds (or bytes, counts)."""
    labels: dict[str, str]
    """Method -> its label in the printout, in the printout's order."""
    rows: tuple[tuple[str, str, str], ...]
    """The plot's rows (method, figure, label), Belayer's paths first, each group above its baselines."""
    targets_ms: dict[tuple[str, str], tuple[float, str | None]] = field(default_factory=dict)
    """Issue 35's targets (p50 ms, the one scenario they are set for or None for all), drawn on their rows."""
    parts: tuple[str, ...] = ()
    """Breakdowns printed as p50s after the methods (``floors``, a rollback's phases)."""
    add_args: Callable[[argparse.ArgumentParser], None] | None = None
    finish: Callable[[dict], None] | None = None
    """Adds what is computed over all scenarios to the result (an estimate)."""
    result_args: tuple[str, ...] = ()
    """Arguments recorded at the top of the result (``fork_n``)."""


def verdicts(result: dict, targets_ms: dict) -> list[dict]:
    """Each target against this run's p50, with the floor measured beside it (``_floors``)
    where one stops it."""
    out = []
    for (method, metric), (target, only) in targets_ms.items():
        for scen, data in result["scenarios"].items():
            if only not in (None, scen) or metric not in data.get(method, {}):
                continue
            p50 = data[method][metric]["p50"] * 1e3
            floors = {k: v["p50"] * (1e3 if k.endswith("_s") else 1) for k, v in data.get("floors", {}).items()}
            row = {"method": method, "metric": metric, "scenario": scen, "target_ms": target,
                   "p50_ms": round(p50, 2), "met": p50 <= target}
            if method == "belayer":
                est = result.get("soft_dirty_estimate", {}).get(scen, {}).get("frozen_s_p50_estimate")
                row["floor_ms"] = {"bare CRIU dump, CRIU's own frozen time (FROZEN to thaw)": floors.get("criu_frozen_s"),
                                   "of it the memory dump (every page: no soft-dirty)": floors.get("criu_memdump_s"),
                                   "bare freezer freeze + thaw": floors.get("freeze_thaw_s")}
                row["with_soft_dirty_estimate_ms"] = None if est is None else round(est * 1e3, 1)
            elif method == "env_standby":
                row["parts_ms"] = {k: round(v["p50"] * 1e3, 3) for k, v in data[method].items() if k != "recovery_s"}
            elif method == "standby":
                row["phases_ms"] = {k: round(v["p50"] * 1e3, 3) for k, v in data.get("standby_phases", {}).items()
                                    if k.endswith("_s")}
                row["floor_ms"] = {"bare freezer freeze + thaw": floors.get("freeze_thaw_s"),
                                   "one fence listing through Docker (moved off)": floors.get("docker_list_s")}
            elif method.startswith("fork_"):
                row["floor_ms"] = {f"{result.get('fork_n')} containers started side by side through Docker, "
                                   "no checkpoint": floors.get("start_n_s")}
            out.append(row)
    return out


def plot_rows(result: dict, path: Path, question: Question) -> None:
    """One panel per scenario, one labelled bar per (method, figure): p50, whisker to p90,
    the issue's target as a red tick where one applies; Docker's own paths and the cold
    start in grey."""
    plt = pyplot()
    if plt is None:
        return
    scenarios = list(result["scenarios"])
    fig, axes = plt.subplots(1, len(scenarios), figsize=(7.5 * len(scenarios), 1.5 + 0.4 * len(question.rows)),
                             squeeze=False)
    for ax, scen in zip(axes[0], scenarios, strict=True):
        data = result["scenarios"][scen]
        rows = [(m, k, label) for m, k, label in question.rows if k in data.get(m, {})]
        for y, (method, metric, _) in enumerate(rows):
            p50, p90 = (data[method][metric][q] * 1e3 for q in ("p50", "p90"))
            ax.barh(y, p50, xerr=[[0], [max(p90 - p50, 0)]], capsize=2, height=0.7,
                    color="0.65" if method in GREY else f"C{0 if metric == 'frozen_s' else 1}")
            ax.text(max(p50, p90) * 1.06, y, f"{p50:.0f}" if p50 >= 10 else f"{p50:.2g}", va="center", fontsize=7)
            target, only = question.targets_ms.get((method, metric), (None, None))
            if target is not None and only in (None, scen):
                ax.plot([target, target], [y - 0.45, y + 0.45], color="red", lw=1.5)
        ax.set_yticks(range(len(rows)), [label.replace("xN", f"x{result.get('fork_n', 'N')}") for *_, label in rows],
                      fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms (bar p50, whisker p90, log; red: target)")
        ax.set_title(f"{question.name} {scen}: {result.get('runs', '?')} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_result(result: dict, question: Question) -> None:
    for scen, data in result["scenarios"].items():
        print(f"\n{scen}:")
        for m in [m for m in question.labels if m in data]:
            cells = "  ".join(f"{k} p50 {v['p50'] * (1e3 if k != 'size_bytes' else 1e-6):7.1f}"
                              f"{'ms' if k != 'size_bytes' else 'MB'} p90 {v['p90'] * (1e3 if k != 'size_bytes' else 1e-6):7.1f}"
                              for k, v in data.get(m, {}).items())
            print(f"  {question.labels[m]:31} {cells}")
        for part in question.parts:
            if data.get(part):
                print(f"  {part} (p50): " + ", ".join(
                    f"{k} {v['p50'] * (1e3 if k.endswith('_s') else 1):.2f}{'ms' if k.endswith('_s') else ''}"
                    for k, v in data[part].items()))
    for row in result.get("targets", []):
        print(f"target {row['method']} {row['metric']} {row['scenario']}: p50 {row['p50_ms']} ms vs "
              f"{row['target_ms']} ms: {'met' if row['met'] else 'NOT met'}; floor {row.get('floor_ms')}")


def main(question: Question) -> int:
    ap = argparse.ArgumentParser(description=question.doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--scenarios", default="idle,heavy")
    if question.add_args:
        question.add_args(ap)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"{question.name}.json"),
                    help=f"default: results/{question.name}.json, the one current result")
    args = ap.parse_args()
    client = connect()
    run_id = uuid.uuid4().hex[:8]
    store_dir = Path(tempfile.mkdtemp(prefix="belayer-bench-", dir="/var/tmp"))
    store = CheckpointStore(store_dir, keep=2)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or None
    result = {"source": {"command": " ".join(["python3", f"benchmarks/{question.name}.py", *sys.argv[1:]]),
                         "commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()),
                         "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}"},
              "host": {"kernel": platform.release(), "cpus": os.cpu_count(),
                       "loadavg_start": os.getloadavg(), "uptime_start": uptime(), "docker": client.version()["Version"],
                       "criu": subprocess.run(["criu", "--version"], capture_output=True, text=True).stdout.split()[1],
                       "store": str(store_dir), "run_id": run_id, "owner": owner_tag(), "loadavg": []},
              "runs": args.runs, **{k: getattr(args, k) for k in question.result_args}, "scenarios": {},
              "note": "the machine was shared with other agents' work: see host.loadavg (1/5/15-min, "
                      "after every run); figures under load are meaningful side by side, as ratios"}
    try:
        for scen in args.scenarios.split(","):
            raw = question.measure(Run(client, scen, args.runs, store, run_id, result["host"]["loadavg"], args))
            result["scenarios"][scen] = {m: {k: summarize(v) for k, v in d.items() if v} for m, d in raw.items()}
            result["scenarios"][scen]["raw"] = raw
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    result["host"]["loadavg_end"] = os.getloadavg()
    result["host"]["uptime_end"] = uptime()
    if question.finish:
        question.finish(result)
    result["targets"] = verdicts(result, question.targets_ms)
    out = save_result(result, args.out, lambda r, p: plot_rows(r, p, question))
    print_result(result, question)
    print(f"\nwrote {out}")
    return 0
