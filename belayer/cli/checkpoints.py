"""``belayer checkpoints ls|rm``: list and remove published full checkpoints."""

from __future__ import annotations

import argparse
import json
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoints", help="list or remove sandbox checkpoints",
                       description="List or remove full checkpoints (file-system layer + CRIU runtime). "
                                   "Store: --store, else $BELAYER_CHECKPOINTS, else $BELAYER_HOME/checkpoints, "
                                   "else ~/.belayer/checkpoints.")
    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])
    cmds = p.add_subparsers(dest="action", metavar="ACTION")

    ls = cmds.add_parser("ls", help="list checkpoints (oldest first)")
    ls.add_argument("--store", metavar="PATH", help="checkpoint store directory")
    ls.add_argument("--sandbox", metavar="NAME", help="only this sandbox's checkpoints")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=run)

    rm = cmds.add_parser("rm", help="remove checkpoints by id, a sandbox's, or incomplete leftovers")
    rm.add_argument("ids", nargs="*", metavar="ID", help="checkpoint ids (from `ls`)")
    rm.add_argument("--store", metavar="PATH", help="checkpoint store directory")
    rm.add_argument("--sandbox", metavar="NAME", help="remove every checkpoint of this sandbox")
    rm.add_argument("--incomplete", action="store_true", help="remove staging left by dead writers")
    rm.add_argument("--json", action="store_true", help="machine-readable output")
    rm.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from belayer_core.errors import CheckpointNotFound, UsageError
    from belayer_env.store.store import CheckpointStore, default_store_path

    if args.action == "rm" and not (args.ids or args.sandbox or args.incomplete):
        raise UsageError("rm needs checkpoint ids, --sandbox NAME or --incomplete")
    path = args.store or default_store_path()
    try:
        # create=False: these commands create nothing; a missing --store is a usage error
        store = CheckpointStore(path, keep=None, create=False)
    except UsageError:
        if args.store:
            raise
        store = None  # the default store does not exist yet: nothing to list or remove
    if args.action == "ls":
        return _ls(args, store, path)
    if store is None:
        if args.ids or args.sandbox:
            raise CheckpointNotFound(f"no checkpoint store at {path} (nothing was ever checkpointed there)")
        print("removed 0 incomplete leftovers")
        return 0
    removed = []
    for ck_id in args.ids:
        store.remove(ck_id)  # CheckpointNotFound (a UsageError) for an unknown id
        removed.append(ck_id)
    if args.sandbox:
        gone = store.prune(args.sandbox, keep=0)
        if not gone:
            raise CheckpointNotFound(f"no checkpoints of sandbox {args.sandbox!r} in {store.path}")
        removed += gone
    cleaned = store.clean_incomplete() if args.incomplete else []
    if args.json:
        print(json.dumps({"removed": removed, "incomplete_removed": cleaned}, indent=2))
    else:
        for r in removed:
            print(f"removed  {r}")
        if args.incomplete:
            print(f"removed {len(cleaned)} incomplete leftovers")
    return 0


def _ls(args: argparse.Namespace, store, path) -> int:
    cks = store.list(args.sandbox) if store is not None else []
    if args.json:
        print(json.dumps({"store": str(path), "total_bytes": sum(c.size_bytes for c in cks),
                          "checkpoints": [_as_dict(c) for c in cks]}, indent=2))
        return 0
    for c in cks:
        kind = "full" if c.has_runtime else "fs-only"
        print(f"{c.id}  step {c.step:<5} {kind:<7} {c.size_bytes / 1e6:8.1f} MB  "
              f"frozen {c.frozen_s * 1e3:6.0f} ms  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(c.created))}")
    where = f"in {path}" if store is not None else f"(no store yet at {path})"
    print(f"{len(cks)} checkpoints, {sum(c.size_bytes for c in cks) / 1e6:.1f} MB {where}")
    return 0


def _as_dict(c) -> dict:
    return {"id": c.id, "sandbox": c.sandbox, "step": c.step, "path": str(c.path), "created": c.created,
            "frozen_s": c.frozen_s, "total_s": c.total_s, "size_bytes": c.size_bytes,
            "has_runtime": c.has_runtime}
