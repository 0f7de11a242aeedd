"""What each of the frozen window's latest cuts saves, side by side in one run (issue 35 item 4).

Four cuts, each with its baseline:

- ``relay``: CRIU calls into the checkpointer at four stages of a dump, three of them inside
  the freeze. ``native``: the static hook set-up lists in runc's CRIU config relays them (one
  exec per stage, which that hook costs anyway); ``script``: a shell script of the dump's
  own, as where the static hook is missing (``BELAYER_CRIU_NATIVE_RELAY=0``): one more exec
  and a shell per stage.
- ``tables``: CRIU's socket collection walks the sandbox namespace's TCP and UDP tables.
  ``own``: the sandbox was created with ``belayer_env/host/netns_hash.py``'s setting (tables
  of its own, 1,024 buckets); ``shared``: created with the setting at 0 (the host's tables;
  262,144 TCP buckets here).
- ``libc``: the static programs CRIU execs inside the freeze (the hook above, at three
  stages; the tmpfs tar, once per tmpfs: six) built against ``musl`` (set-up's default
  where musl-tools is installed) or ``glibc`` (built here for the run; the hook swapped in
  place for the capture, the tar put first in CRIU's PATH).

- ``init``: the sandbox's PID 1 (``sandbox/config.py``). ``one``: bash alone, blocked in a
  read of its own FIFO; ``two``: bash waiting on a ``sleep`` child (``LEGACY_INIT_COMMANDS``).

Variants: ``baseline`` (all four off: shared tables, two-process init, script relay,
glibc), each cut alone, and ``all`` (as set-up and this version leave a host). Per scenario
(``idle``, ``heavy`` as in the checkpoint benchmarks, ``_checkpoint_common.py``) one sandbox per (tables, init) pair the
variants use; every variant is captured once per round, in an order that rotates by round,
an agent-like step before each capture. The host's settings and the installed hook are put
back at the end.

    python3 benchmarks/freeze_cuts.py --runs 12 --scenarios idle,heavy

Writes ``benchmarks/results/freeze_cuts.json`` (+ ``.png``); Docker + CRIU + set-up, root.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_env.capture.checkpoint import full_checkpoint  # noqa: E402
from belayer_env.criu import runtime  # noqa: E402
from belayer_env.host import fast_tar, loopback, netns_hash  # noqa: E402
from belayer_env.host.native import NATIVE, compile_static  # noqa: E402
from belayer_env.sandbox import create  # noqa: E402
from belayer_env.sandbox.config import INIT_COMMAND, LEGACY_INIT_COMMANDS  # noqa: E402
from belayer_env.sandbox.docker_api import connect  # noqa: E402
from belayer_env.sandbox.fence import fence  # noqa: E402
from belayer_env.store.manifest import read_manifest  # noqa: E402
from belayer_env.store.store import CheckpointStore  # noqa: E402
from benchmarks._checkpoint_common import STEP, bench_sandbox, settle, uptime  # noqa: E402
from benchmarks._plotting import pyplot, save_result  # noqa: E402

VARIANTS = {"baseline": ("shared", "two", "script", "glibc"), "relay only": ("shared", "two", "native", "glibc"),
            "tables only": ("own", "two", "script", "glibc"), "musl only": ("shared", "two", "script", "musl"),
            "init only": ("shared", "one", "script", "glibc"), "all": ("own", "one", "native", "musl")}
"""name -> (tables, init, relay, libc)"""


class GlibcHelpers:
    """The hook and the tmpfs tar built against glibc, swapped in for one capture at a time."""

    def __init__(self, tmp: Path):
        self.hook = tmp / "hook-glibc"
        compile_static(self.hook, [NATIVE / loopback.HOOK_SOURCE], libc="glibc")
        self.musl_hook = tmp / "hook-installed"
        shutil.copy2(loopback.HOOK_PATH, self.musl_hook)
        self.tar_dir = tmp / "tar-glibc"
        self.tar_dir.mkdir()
        fast_tar.build(self.tar_dir / "tar", libc="glibc")
        os.chmod(self.tar_dir / "tar", 0o755)
        self._dump_path = fast_tar.dump_path

    def use(self, libc: str) -> None:
        source = self.hook if libc == "glibc" else self.musl_hook
        staged = loopback.HOOK_PATH.with_name(f".{loopback.HOOK_PATH.name}.bench")
        shutil.copy2(source, staged)
        os.replace(staged, loopback.HOOK_PATH)
        fast_tar.dump_path = ((lambda path: f"{self.tar_dir}:{path or os.defpath}") if libc == "glibc"
                              else self._dump_path)

    def restore(self) -> None:
        self.use("musl")


def set_tables(size: int) -> None:
    for path in netns_hash.SETTINGS.values():
        path.write_text(f"{size}\n")


def summarize(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"n": len(s), "p50": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))],
            "min": s[0], "max": s[-1], "samples": samples}


def run_scenario(client, scenario: str, runs: int, store: CheckpointStore, run_id: str, found: dict,
                 glibc: GlibcHelpers) -> dict:
    sandboxes = {}
    try:
        for tables, init in sorted({v[:2] for v in VARIANTS.values()}):
            set_tables(0 if tables == "shared" else netns_hash.TARGET_ENTRIES)
            create.INIT_COMMAND = INIT_COMMAND if init == "one" else LEGACY_INIT_COMMANDS[0]
            try:
                sandboxes[tables, init] = bench_sandbox(client, scenario, f"{run_id}-{tables}-{init}")
            finally:
                create.INIT_COMMAND = INIT_COMMAND
        for proto, value in found.items():
            netns_hash.SETTINGS[proto].write_text(f"{value}\n")
        for sb in sandboxes.values():
            full_checkpoint(sb, store)  # each sandbox's first capture (everything copied): not measured
        names = list(VARIANTS)
        out = {v: {"frozen_s": [], "criu_frozen_s": [], "load1": []} for v in names}
        for i in range(runs):
            for k in range(len(names)):
                variant = names[(i + k) % len(names)]
                tables, init, relay, libc = VARIANTS[variant]
                sb = sandboxes[tables, init]
                sb.execute(STEP.format(i=i * len(names) + k))
                settle()
                runtime.NATIVE_RELAY = relay == "native"
                glibc.use(libc)
                try:
                    taken = full_checkpoint(sb, store)
                finally:
                    glibc.restore()
                detail = read_manifest(taken.path).get("frozen_detail") or {}
                row = out[variant]
                row["frozen_s"].append(taken.frozen_s)
                row["criu_frozen_s"].append(detail.get("criu_frozen_s", 0.0))
                row["load1"].append(os.getloadavg()[0])
            print(f"  {scenario} round {i + 1}/{runs}: " + ", ".join(
                f"{v} {out[v]['frozen_s'][-1] * 1e3:.0f}" for v in names)
                + f" ms frozen, load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        runtime.NATIVE_RELAY = True
        glibc.restore()
        for proto, value in found.items():
            netns_hash.SETTINGS[proto].write_text(f"{value}\n")
        for c in client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"}):
            fence(client, c["Names"][0].lstrip("/"), background=False)
    return {v: {k: summarize(s) for k, s in row.items() if s} for v, row in out.items()}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    scenarios = list(result["scenarios"])
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        data = result["scenarios"][scenario]
        labels = list(VARIANTS)
        p50 = [data[v]["frozen_s"]["p50"] * 1e3 for v in labels]
        p90 = [data[v]["frozen_s"]["p90"] * 1e3 for v in labels]
        y = range(len(labels))
        ax.barh(y, p90, color="#cccccc", label="p90")
        ax.barh(y, p50, color="#4477aa", label="p50")
        for yi, v in zip(y, p50, strict=True):
            ax.text(v, yi, f" {v:.1f}", va="center", fontsize=8)
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.set_xlabel("frozen window (ms)")
        ax.set_title(f"{scenario}: frozen window by cut")
        ax.legend(fontsize=8)
    fig.suptitle(result["source"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--scenarios", default="idle,heavy")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "freeze_cuts.json"))
    args = ap.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := [s for s in scenarios if s not in ("idle", "heavy")]:
        ap.error(f"unknown scenario(s) {unknown}: idle, heavy")
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    found = netns_hash.sizes()
    if not found or not loopback.relays() or not fast_tar.installed() or not shutil.which("musl-gcc"):
        print("needs set-up's static CRIU hook and tmpfs tar, musl-gcc and a kernel with per-namespace "
              "socket tables (bash scripts/setup.sh)", file=sys.stderr)
        return 2
    client = connect()
    run_id = uuid.uuid4().hex[:8]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or None
    result = {"source": f"python3 benchmarks/freeze_cuts.py --runs {args.runs} --scenarios {args.scenarios}",
              "commit": commit, "date": time.strftime("%Y-%m-%d"),
              "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "uptime_at_start": uptime()},
              "settings_found": found, "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="belayer-bench-") as tmp:
        store = CheckpointStore(Path(tmp) / "store", keep=1)
        glibc = GlibcHelpers(Path(tmp))
        for scenario in scenarios:
            result["scenarios"][scenario] = run_scenario(client, scenario, args.runs, store, run_id, found, glibc)
    result["host"]["uptime_at_end"] = uptime()
    for scenario, data in result["scenarios"].items():
        base = data["baseline"]["frozen_s"]["p50"]
        for v in VARIANTS:
            row = data[v]["frozen_s"]
            print(f"{scenario:5s} {v:12s} frozen p50 {row['p50'] * 1e3:6.1f} ms  p90 {row['p90'] * 1e3:6.1f}  "
                  f"({row['p50'] / base:.2f}x the baseline)")
    print(f"wrote {save_result(result, args.out, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
