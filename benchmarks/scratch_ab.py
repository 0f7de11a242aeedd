"""Frozen time with the capture scratch on a plain tmpfs vs the large-folio one, side by side.

CRIU writes the sandbox's memory into the scratch while the sandbox is frozen
(``belayer_env/store/scratch.py``). One sandbox (``idle`` or ``heavy``, as in
checkpoint_bench.py), two stores: ``plain`` has its scratch in a directory of /dev/shm
(what every capture used before), ``large`` the default root, mounted with
``huge=within_size``. Rounds as in ``_capture_ab.py`` (one capture per store each, in
alternating order).

    python3 benchmarks/scratch_ab.py --runs 10 --scenarios idle,heavy
Writes benchmarks/results/scratch_ab.json and .png; Docker + CRIU, root.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
import uuid
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _capture_ab import Variant, parse_args, plot_ab, print_ab, run_rounds, summarize_ab  # noqa: E402
from _plotting import save_result  # noqa: E402

from belayer_env.sandbox.docker_api import connect  # noqa: E402
from belayer_env.store import scratch  # noqa: E402
from belayer_env.store.store import CheckpointStore  # noqa: E402

VARIANTS = ("plain", "large")


def main() -> int:
    args = parse_args(__doc__, "scratch_ab", "default: benchmarks/results/scratch_ab.json")
    out = args.out or str(Path(__file__).parent / "results" / "scratch_ab.json")
    client = connect()
    run_id = uuid.uuid4().hex[:8]
    work = Path(tempfile.mkdtemp(prefix="belayer-scratch-ab-", dir="/var/tmp"))
    plain_base = Path(tempfile.mkdtemp(prefix="belayer-scratch-ab-", dir="/dev/shm"))
    stores = {"plain": CheckpointStore(work / "plain", keep=2, scratch=plain_base),
              "large": CheckpointStore(work / "large", keep=2)}
    large_options = scratch.mount_options(stores["large"].scratch_root)
    result = {"host": {"kernel": platform.release(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                       "run_id": run_id},
              "scratch": {"plain": str(stores["plain"].scratch_root),
                          "large": f"{stores['large'].scratch_root} ({large_options or 'NOT the large-folio tmpfs'})"},
              "runs": args.runs, "scenarios": {}}
    if large_options is None:
        print("warning: the default scratch root is not the large-folio tmpfs here; both variants are plain",
              file=sys.stderr)
    try:
        for scen in args.scenarios.split(","):
            raw = run_rounds(client, scen, args.runs, {v: Variant(stores[v]) for v in VARIANTS}, run_id)
            result["scenarios"][scen] = summarize_ab(raw, *VARIANTS)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(plain_base, ignore_errors=True)
    result["host"]["loadavg_end"] = os.getloadavg()
    path = save_result(result, out, partial(plot_ab, variants=VARIANTS, label="scratch"))
    print_ab(result, *VARIANTS)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
