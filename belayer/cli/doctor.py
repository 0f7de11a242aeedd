"""``belayer doctor``: is this machine ready? Exit 0 only when every required check holds."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check Docker, CRIU, kernel, base image and disk",
                       description="Check that this machine can run Belayer; each failure says how to fix it.")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from belayer_env.ops.doctor import run_checks

    checks = run_checks()
    ok = all(c.ok for c in checks if c.required)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [c.to_dict() for c in checks]}, indent=2))
    else:
        for c in checks:
            mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
            print(f"[{mark}] {c.name:<26} {c.detail}")
            if not c.ok and c.fix:
                print(f"       fix: {c.fix}")
        print("ready" if ok else "not ready: fix the FAIL lines above")
    return 0 if ok else 1
