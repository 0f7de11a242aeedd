"""``belayer gc``: reap sandbox containers, engine processes and arena shared-memory files
orphaned by a crashed process."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from pathlib import Path

DOCKER_TIMEOUT_S = 20.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gc", help="remove sandbox containers, engine processes and arena shm files whose owner is gone",
                       description="Remove Belayer sandbox containers whose owner process no longer runs, end engine "
                                   "processes (arenas, workers, shadows) whose engine is gone (owner pid + start "
                                   "time), remove the /dev/shm files (weights, KV) of arenas that were killed "
                                   "and the temporary run dirs (logs, sockets) of engines that were, "
                                   "the shared layers of forks that no container uses any more, the processes of "
                                   "dumps whose checkpointer died (runc, CRIU, action scripts), and the copies of "
                                   "checkpoints that containerd unpacked for restores whose process is gone "
                                   "(containerd never removes them), and the tasks (with their shims) and "
                                   "containers containerd still holds of sandbox containers Docker has "
                                   "forgotten (looked up with ctr).")
    p.add_argument("--all", action="store_true", help="remove every Belayer container, owned or not "
                                                      "(arena files of running arenas are always kept)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.epilog = ("Paused (frozen) containers are thawed through their cgroup first. A container that still "
                "cannot be removed is reported with the reason; the others are removed all the same (exit 1).")
    p.set_defaults(func=run)


def _end_processes(pids: list[int], timeout: float = 10.0) -> list[int]:
    """SIGKILL each orphan's process group (each was started in its own session); the
    pids that are gone within ``timeout``."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if not Path(f"/proc/{p}").exists()]


def run(args: argparse.Namespace) -> int:
    from belayer_engine.arena.shm_files import orphaned, reap_orphans
    from belayer_engine.backends.sglang import shm_files as sglang_shm
    from belayer_engine.common.owner import orphans
    from belayer_engine.supervisor import run_dir as engine_run_dirs
    from belayer_env.ops.gc import (
        GcReport,
        containerd_leftovers,
        dump_helpers,
        end_dump_helpers,
        list_managed,
        remove_all,
        sweep_shared_layers,
    )
    from belayer_env.restore import ctrd_copies
    from belayer_env.sandbox.docker_api import connect

    engine_procs = orphans()
    ended = [] if args.dry_run else _end_processes([pid for pid, _ in engine_procs])
    helpers = dump_helpers()  # runc, CRIU, action scripts of dumps whose checkpointer died
    helpers_ended = [] if args.dry_run else end_dump_helpers(helpers)
    arena_files = [str(p) for p in orphaned()] if args.dry_run else reap_orphans()
    arena_files += [str(p) for p in sglang_shm.orphaned()] if args.dry_run else sglang_shm.reap_orphans()
    run_dirs = [str(p) for p in engine_run_dirs.orphaned()] if args.dry_run else engine_run_dirs.reap_orphans()
    client = connect(timeout=DOCKER_TIMEOUT_S)  # every Docker call bounded: a wedged container cannot hang gc
    managed = list_managed(client)
    targets = [c for c in managed if args.all or c.orphaned]
    report = GcReport() if args.dry_run else remove_all(client, targets)
    removed, failed = report.removed, report.failed
    ctrd = containerd_leftovers(client, dry_run=args.dry_run)  # after Docker's removals, which can leave them
    shared_layers = sweep_shared_layers(client, dry_run=args.dry_run)  # after the containers that used them
    copies = [str(p) for p in ctrd_copies.sweep(dry_run=args.dry_run)]  # containerd's, of dead restores
    if args.json:
        print(json.dumps({
            "managed": len(managed),
            "orphaned": sum(c.orphaned for c in managed),
            "targets": [c.name for c in targets],
            "removed": [c.name for c in targets if c.id in removed],
            "failed": {c.name: failed[c.id] for c in targets if c.id in failed},
            "engine_processes": [{"pid": pid, "owner": own, "ended": pid in ended} for pid, own in engine_procs],
            "dump_helpers": [{"pid": h.pid, "comm": h.comm, "owner": h.owner, "container": h.container,
                              "ended": h.pid in helpers_ended} for h in helpers],
            "arena_files": arena_files,
            "engine_run_dirs": run_dirs,
            "shared_layers": shared_layers,
            "containerd_checkpoint_copies": copies,
            "containerd_leftovers": [{"id": lo.id, "task": lo.task, "pid": lo.pid, "removed": lo.id in ctrd.removed,
                                      "failed": ctrd.failed.get(lo.id)} for lo in ctrd.found],
            "containerd_unavailable": ctrd.unavailable,
            "dry_run": args.dry_run,
        }, indent=2))
    else:
        for pid, own in engine_procs:
            verb = "would end" if args.dry_run else ("ended" if pid in ended else "still alive")
            print(f"{verb:>12}  engine process {pid}  (owner {own} gone)")
        for h in helpers:
            verb = "would end" if args.dry_run else ("ended" if h.pid in helpers_ended else "still alive")
            print(f"{verb:>12}  {h.comm} {h.pid}  (a dump of {h.container[:12]}; its checkpointer {h.owner} is gone)")
        for path in arena_files:
            print(f"{'would remove' if args.dry_run else 'removed':>12}  {path}  (arena process gone)")
        for path in run_dirs:
            print(f"{'would remove' if args.dry_run else 'removed':>12}  {path}  (engine run dir; its engine is gone)")
        for name in shared_layers:
            print(f"{'would remove' if args.dry_run else 'removed':>12}  shared fork layer {name}  "
                  "(no container uses it" + (" now)" if args.dry_run else ")"))
        for path in copies:
            print(f"{'would remove' if args.dry_run else 'removed':>12}  {path}  (containerd's copy of a "
                  "checkpoint; its restore's process is gone)")
        for lo in ctrd.found:
            verb = "would remove" if args.dry_run else ("FAILED" if lo.id in ctrd.failed else "removed")
            task = f"task {lo.task}" + (f", pid {lo.pid}" if lo.pid else "") if lo.task else "no task"
            why = f": {ctrd.failed[lo.id]}" if lo.id in ctrd.failed else ""
            print(f"{verb:>12}  containerd container {lo.id[:12]}  ({task}; Docker does not know it){why}")
        if ctrd.unavailable:
            print(f"{'cannot look':>12}  at containerd's leftovers: {ctrd.unavailable}")
        for c in targets:
            verb = "would remove" if args.dry_run else ("FAILED" if c.id in failed else "removed")
            why = f": {failed[c.id]}" if c.id in failed else ""
            print(f"{verb:>12}  {c.name}  ({c.status}, owner {c.owner}){why}")
        done = f"{len(targets)} to remove" if args.dry_run else f"{len(removed)} removed"
        print(f"{len(managed)} belayer containers, {done}" + (f", {len(failed)} could not be removed" if failed else ""))
    return 1 if failed or ctrd.failed else 0
