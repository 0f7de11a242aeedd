"""Frozen time with the kernel's default conntrack table vs the one set-up leaves, side by side.

CRIU walks the whole conntrack hash table twice inside every capture's freeze
(``belayer_env/conntrack.py``). One sandbox (``idle`` or ``heavy``, as in
checkpoint_bench.py), one store; before each capture the table is resized to the variant's
bucket count (``default``: 262,144, the kernel's on hosts with 4 GiB or more; ``tuned``:
what ``bash scripts/setup.sh`` sets). Rounds as in ``_capture_ab.py``; the count found at
the start is put back at the end. Also times one walk at each size from here.

    python3 benchmarks/conntrack_ab.py --runs 10 --scenarios idle,heavy
Writes benchmarks/results/conntrack_ab.json and .png; Docker + CRIU, root.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import uuid
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _capture_ab import Variant, plot_ab, print_ab, run_rounds, summarize_ab  # noqa: E402
from _plotting import save_result  # noqa: E402

from belayer_env import conntrack  # noqa: E402
from belayer_env.checkpoint.store import CheckpointStore  # noqa: E402
from belayer_env.docker_api import connect  # noqa: E402

VARIANTS = ("default", "tuned")


def resize(n: int) -> None:
    conntrack.BUCKETS_PATH.write_text(f"{n}\n")
    assert conntrack.buckets() == n, f"the kernel kept {conntrack.buckets()} buckets, not {n}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="rounds per scenario (one capture per variant each)")
    ap.add_argument("--scenarios", default="idle,heavy")
    ap.add_argument("--default-buckets", type=int, default=262144)
    ap.add_argument("--tuned-buckets", type=int, default=conntrack.TARGET_BUCKETS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "conntrack_ab.json"))
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    if os.geteuid() != 0:
        print("conntrack_ab: needs root (Docker, runc, CRIU, the conntrack sysctl)", file=sys.stderr)
        return 2
    found = conntrack.buckets()
    if found is None:
        print("conntrack_ab: this kernel has no conntrack table: nothing to compare", file=sys.stderr)
        return 2
    sizes = {"default": args.default_buckets, "tuned": args.tuned_buckets}
    client = connect()
    run_id = uuid.uuid4().hex[:8]
    work = Path(tempfile.mkdtemp(prefix="belayer-conntrack-ab-", dir="/var/tmp"))
    store = CheckpointStore(work / "store", keep=2)
    result = {"host": {"kernel": platform.release(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                       "run_id": run_id, "buckets_found": found},
              "buckets": sizes, "runs": args.runs, "walk_ms_p50": {}, "scenarios": {}}
    try:
        for v, n in sizes.items():
            resize(n)
            result["walk_ms_p50"][v] = round(statistics.median(conntrack.walk_s() for _ in range(9)) * 1e3, 3)
        for scen in args.scenarios.split(","):
            variants = {v: Variant(store, partial(resize, n)) for v, n in sizes.items()}
            raw = run_rounds(client, scen, args.runs, variants, run_id)
            result["scenarios"][scen] = summarize_ab(raw, *VARIANTS)
    finally:
        resize(found)
        shutil.rmtree(work, ignore_errors=True)
    result["host"]["loadavg_end"] = os.getloadavg()
    out = save_result(result, args.out, partial(plot_ab, variants=VARIANTS, label="conntrack buckets"))
    print("one conntrack walk, p50: " + ", ".join(f"{v} ({sizes[v]}) {ms:.2f} ms"
                                                  for v, ms in result["walk_ms_p50"].items()))
    print_ab(result, *VARIANTS)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
