"""``belayer gc``: reap sandbox containers and arena shared-memory files orphaned by a crashed process."""

from __future__ import annotations

import argparse
import json

DOCKER_TIMEOUT_S = 20.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gc", help="remove sandbox containers and arena shm files whose owning process is gone",
                       description="Remove Belayer sandbox containers whose owner process no longer runs, and the "
                                   "/dev/shm files (weights, KV) of arenas that were killed.")
    p.add_argument("--all", action="store_true", help="remove every Belayer container, owned or not "
                                                      "(arena files of running arenas are always kept)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.epilog = ("Paused (frozen) containers are thawed through their cgroup first. A container that still "
                "cannot be removed is reported with the reason; the others are removed all the same (exit 1).")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from belayer_engine.arena.shm_files import orphaned, reap_orphans
    from belayer_env.docker_api import connect
    from belayer_env.gc import GcReport, list_managed, remove_all

    arena_files = [str(p) for p in orphaned()] if args.dry_run else reap_orphans()
    client = connect(timeout=DOCKER_TIMEOUT_S)  # every Docker call bounded: a wedged container cannot hang gc
    managed = list_managed(client)
    targets = [c for c in managed if args.all or c.orphaned]
    report = GcReport() if args.dry_run else remove_all(client, targets)
    removed, failed = report.removed, report.failed
    if args.json:
        print(json.dumps({
            "managed": len(managed),
            "orphaned": sum(c.orphaned for c in managed),
            "targets": [c.name for c in targets],
            "removed": [c.name for c in targets if c.id in removed],
            "failed": {c.name: failed[c.id] for c in targets if c.id in failed},
            "arena_files": arena_files,
            "dry_run": args.dry_run,
        }, indent=2))
    else:
        for path in arena_files:
            print(f"{'would remove' if args.dry_run else 'removed':>12}  {path}  (arena process gone)")
        for c in targets:
            verb = "would remove" if args.dry_run else ("FAILED" if c.id in failed else "removed")
            why = f": {failed[c.id]}" if c.id in failed else ""
            print(f"{verb:>12}  {c.name}  ({c.status}, owner {c.owner}){why}")
        done = f"{len(targets)} to remove" if args.dry_run else f"{len(removed)} removed"
        print(f"{len(managed)} belayer containers, {done}" + (f", {len(failed)} could not be removed" if failed else ""))
    return 1 if failed else 0
