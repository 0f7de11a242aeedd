"""Restores and forks with one of Belayer's restore-side cuts and without it, side by side.

``--knob tmpfs-tar``: CRIU refills every tmpfs of a restored sandbox with ``tar --extract
--gzip``; with ``belayer_env/host/fast_tar.py``'s helper first in dockerd's PATH
(``bash scripts/setup.sh`` starts dockerd so) that runs in-process. ``default``: GNU tar
(the helper's ``restore-off`` file present, so it hands every archive over), ``tuned``: the
helper. The restore logs of the last round are checked: every tmpfs of a ``tuned`` restore
said it was extracted in-process, none of a ``default`` one.

``--knob loopback-hook``: CRIU runs the action script of ``/etc/criu/runc.conf`` at every
stage (``belayer_env/host/loopback.py``); ``default``: the shell script, ``tuned``: the static
hook set-up builds (swapped in place, atomically, between restores; put back at the end).

``--knob thp``: the host's transparent huge pages, ``default``: ``madvise`` (Debian's),
``tuned``: ``always`` (CRIU's restore could then map the restored heap with 2 MiB pages),
flipped between restores, put back as found at the end.

``--knob mount-calls``: every loop and tmpfs mount Belayer makes (a sandbox's disk cap at
create, a fork's shared layer and images, a restore's unpacks); ``default``: through
``mount(8)``/``umount(8)`` (what Belayer ran before ``belayer_env/sandbox/mounting.py``),
``tuned``: the system calls.

Each round: an agent-like step, one capture, then per variant (alternating order) one
``full_restore`` (not pre-staged) and one ``fork(ck, n)``, each timed end to end and
fenced after.

    python3 benchmarks/restore_ab.py --knob tmpfs-tar --runs 8 --scenarios idle,heavy --fork-n 8
Writes benchmarks/results/restore_ab_<knob>.json and .png; Docker + CRIU, root.
"""

from __future__ import annotations

import argparse
import errno
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plotting import plot_pairs, save_result  # noqa: E402
from checkpoint_bench import STEP, bench_sandbox, settle, summarize, sweep_shared_layers  # noqa: E402

from belayer_env.capture.checkpoint import full_checkpoint  # noqa: E402
from belayer_env.forks.fork import fork  # noqa: E402
from belayer_env.host import fast_tar, loopback  # noqa: E402
from belayer_env.restore import prestaging  # noqa: E402
from belayer_env.restore.restore import full_restore  # noqa: E402
from belayer_env.sandbox import mounting  # noqa: E402
from belayer_env.sandbox.docker_api import connect  # noqa: E402
from belayer_env.sandbox.fence import fence  # noqa: E402
from belayer_env.store.store import CheckpointStore  # noqa: E402

VARIANTS = ("default", "tuned")
METRICS = ("restore_s", "fork_s")


def use_helper(on: bool) -> None:
    if on:
        fast_tar.RESTORE_OFF.unlink(missing_ok=True)
    else:
        fast_tar.RESTORE_OFF.touch()


def tmpfs_tar_knob() -> tuple[Callable[[bool], None], Callable[[], None]]:
    if not fast_tar.installed() or fast_tar.dockerd_uses_it() is not True:
        raise SystemExit(f"restore_ab: restores do not run {fast_tar.HELPER} (bash scripts/setup.sh builds it and "
                         "starts dockerd with it first in PATH): nothing to compare")
    found_off = fast_tar.RESTORE_OFF.exists()
    return use_helper, partial(use_helper, not found_off)


def hook_knob() -> tuple[Callable[[bool], None], Callable[[], None]]:
    """Swap the installed static hook and the shell script (both do the job) in place."""
    if loopback.hook_kind() != "static":
        raise SystemExit(f"restore_ab: {loopback.HOOK_PATH} is not the static hook (bash scripts/setup.sh)")
    static = loopback.HOOK_PATH.read_bytes()

    def use(on: bool) -> None:
        tmp = loopback.HOOK_PATH.with_name(f".{loopback.HOOK_PATH.name}.ab")
        tmp.write_bytes(static if on else loopback.HOOK_SCRIPT.encode())
        tmp.chmod(0o755)
        os.replace(tmp, loopback.HOOK_PATH)

    return use, partial(use, True)


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_knob() -> tuple[Callable[[bool], None], Callable[[], None]]:
    """The host's transparent huge pages: ``madvise`` (Debian's default) vs ``always`` during the restores."""
    if not THP.exists():
        raise SystemExit(f"restore_ab: {THP} missing (a kernel without transparent huge pages): nothing to compare")
    found = THP.read_text().split("[")[1].split("]")[0]

    def use(on: bool) -> None:
        THP.write_text("always" if on else "madvise")

    return use, lambda: THP.write_text(found)


def _mount8(argv: list[str]) -> None:
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise OSError(errno.EIO, f"{' '.join(argv)}: {p.stderr.strip()}")


def mount_calls_knob() -> tuple[Callable[[bool], None], Callable[[], None]]:
    """``mounting``'s three functions, or the same through ``mount(8)`` and ``umount(8)``."""
    calls = (mounting.loop_mount, mounting.mount, mounting.umount)
    by_tools = (lambda image, target, fstype="ext4": _mount8(["mount", "-t", fstype, "-o", "loop", str(image), str(target)]),
                lambda source, target, fstype, options="": _mount8(
                    ["mount", "-t", fstype, *(["-o", options] if options else []), str(source), str(target)]),
                lambda target, lazy=False: _mount8(["umount", *(["-l"] if lazy else []), str(target)]))

    def use(on: bool) -> None:
        mounting.loop_mount, mounting.mount, mounting.umount = calls if on else by_tools

    return use, partial(use, True)


KNOBS = {"tmpfs-tar": tmpfs_tar_knob, "loopback-hook": hook_knob, "thp": thp_knob, "mount-calls": mount_calls_knob}


def in_process_count(client, cid: str) -> int:
    log = fast_tar.restore_log(prestaging.docker_root(client), cid)
    return log.read_text(errors="replace").count(fast_tar.EXTRACTED)


def one_round(client, ck, fork_n: int, order: tuple[str, ...], raw: dict, check: bool,
              use: Callable[[bool], None]) -> None:
    for variant in order:
        use(variant == "tuned")
        settle()
        t = time.perf_counter()
        sb = full_restore(ck, client=client, name=f"{ck.sandbox}-r{uuid.uuid4().hex[:6]}", use_staged=False)
        raw[variant]["restore_s"].append(time.perf_counter() - t)
        if check:
            n = in_process_count(client, sb.container_id)
            assert (n > 0) == (variant == "tuned"), f"{variant}: {n} tmpfs extracted in-process"
            raw[variant]["tmpfs_in_process"] = n
        fence(client, sb.name, background=False)
        settle()
        t = time.perf_counter()
        forks = fork(ck, fork_n, client=client)
        raw[variant]["fork_s"].append(time.perf_counter() - t)
        for f in forks:
            fence(client, f.name, background=False)


def run(client, scenario: str, runs: int, fork_n: int, run_id: str, knob: str, use: Callable[[bool], None]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="belayer-restore-ab-", dir="/var/tmp"))
    store = CheckpointStore(work / "store", keep=2)
    raw = {v: {m: [] for m in METRICS} for v in VARIANTS}
    sb = bench_sandbox(client, scenario, run_id)
    try:
        for i in range(runs):
            sb.execute(STEP.format(i=i))
            ck = full_checkpoint(sb, store)
            one_round(client, ck, fork_n, VARIANTS if i % 2 == 0 else VARIANTS[::-1], raw,
                      check=knob == "tmpfs-tar" and i == runs - 1, use=use)
            print(f"  {scenario} round {i + 1}/{runs}: " + ", ".join(
                f"{v} restore {raw[v]['restore_s'][-1] * 1e3:.0f} ms fork x{fork_n} {raw[v]['fork_s'][-1] * 1e3:.0f} ms"
                for v in VARIANTS) + f", load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        sb.close()
        for c in client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"}):
            fence(client, c["Names"][0].lstrip("/"), background=False)
        sweep_shared_layers(client)
        shutil.rmtree(work, ignore_errors=True)
    data = {v: {m: summarize(raw[v][m]) for m in METRICS} for v in VARIANTS}
    for m in METRICS:
        data[f"ratio_{m}_p50"] = data["tuned"][m]["p50"] / max(data["default"][m]["p50"], 1e-9)
    data["raw"] = raw
    return data


def plot(result: dict, path: Path) -> None:
    plot_pairs(result, path, VARIANTS, result["knob"], METRICS, ["restore", f"fork x{result['fork_n']}"],
               lambda scen, data: f"{scen}: restore {data['ratio_restore_s_p50']:.2f}x, "
                                  f"fork {data['ratio_fork_s_p50']:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--knob", required=True, choices=sorted(KNOBS))
    ap.add_argument("--runs", type=int, default=8, help="rounds per scenario (one restore + one fork per variant)")
    ap.add_argument("--scenarios", default="idle,heavy")
    ap.add_argument("--fork-n", type=int, default=8)
    ap.add_argument("--out", help="default: benchmarks/results/restore_ab_<knob>.json")
    args = ap.parse_args()
    if args.runs < 1 or not 1 <= args.fork_n <= 64:
        ap.error("--runs must be >= 1 and --fork-n in 1..64")
    if os.geteuid() != 0:
        print("restore_ab: needs root (Docker, runc, CRIU, the knob it flips)", file=sys.stderr)
        return 2
    out = args.out or str(Path(__file__).parent / "results" / f"restore_ab_{args.knob.replace('-', '_')}.json")
    use, put_back = KNOBS[args.knob]()
    client = connect()
    run_id = uuid.uuid4().hex[:8]
    result = {"host": {"kernel": platform.release(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                       "run_id": run_id}, "knob": args.knob, "runs": args.runs, "fork_n": args.fork_n,
              "scenarios": {}}
    try:
        for scen in args.scenarios.split(","):
            result["scenarios"][scen] = run(client, scen, args.runs, args.fork_n, run_id, args.knob, use)
    finally:
        put_back()
    result["host"]["loadavg_end"] = os.getloadavg()
    path = save_result(result, out, plot)
    for scen, data in result["scenarios"].items():
        print(f"{scen}: " + "; ".join(
            f"{v}: restore p50 {data[v]['restore_s']['p50'] * 1e3:.0f} ms p90 {data[v]['restore_s']['p90'] * 1e3:.0f}, "
            f"fork p50 {data[v]['fork_s']['p50'] * 1e3:.0f} ms p90 {data[v]['fork_s']['p90'] * 1e3:.0f}"
            for v in VARIANTS) + f"; restore {data['ratio_restore_s_p50']:.2f}x, fork {data['ratio_fork_s_p50']:.2f}x")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
