"""A worker program for ``test_fork_template``: prints its args, an env value and whether it
leads its own session; ``sleep`` waits to be killed; else exits with its second arg."""

from __future__ import annotations

import os
import time


def main(argv: list[str]) -> int:
    if argv[0] == "sleep":
        time.sleep(600)
        return 0
    print(argv[0], os.environ.get("ONLY"), os.getsid(0) == os.getpid(), flush=True)
    return int(argv[1])
