"""``belayer gc``: reap sandbox containers and arena shared-memory files orphaned by a crashed process."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gc", help="remove sandbox containers and arena shm files whose owning process is gone",
                       description="Remove Belayer sandbox containers whose owner process no longer runs, and the "
                                   "/dev/shm files (weights, KV) of arenas that were killed.")
    p.add_argument("--all", action="store_true", help="remove every Belayer container, owned or not "
                                                      "(arena files of running arenas are always kept)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from belayer_engine.arena.shm_files import orphaned, reap_orphans
    from belayer_env.docker_api import connect
    from belayer_env.gc import list_managed, reap

    arena_files = [str(p) for p in orphaned()] if args.dry_run else reap_orphans()
    client = connect()
    managed = list_managed(client)
    targets = [c for c in managed if args.all or c.orphaned]
    removed = [] if args.dry_run else reap(client, targets)
    if args.json:
        print(json.dumps({
            "managed": len(managed),
            "orphaned": sum(c.orphaned for c in managed),
            "targets": [c.name for c in targets],
            "removed": [c.name for c in targets if c.id in removed],
            "arena_files": arena_files,
            "dry_run": args.dry_run,
        }, indent=2))
    else:
        for path in arena_files:
            print(f"{'would remove' if args.dry_run else 'removed':>12}  {path}  (arena process gone)")
        for c in targets:
            verb = "would remove" if args.dry_run else ("removed" if c.id in removed else "gone")
            print(f"{verb:>12}  {c.name}  ({c.status}, owner {c.owner})")
        print(f"{len(managed)} belayer containers, {len(targets)} {'to remove' if args.dry_run else 'removed'}")
    return 0
