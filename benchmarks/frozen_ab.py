"""Frozen time with and without one of Belayer's host-level cuts, side by side.

``--knob conntrack``: CRIU walks the host's whole conntrack hash table twice inside every
capture's freeze (``belayer_env/host/conntrack.py``); before each capture the table is resized
to the variant's bucket count (``default``: 262,144, the kernel's with 4 GiB or more;
``tuned``: what ``bash scripts/setup.sh`` sets); the count found at the start is put back
at the end; one walk is also timed at each size from here.

``--knob cgroup-yard``: CRIU mounts every cgroup hierarchy inside the freeze unless the dump
names a yard (``belayer_env/criu/cgroup_yard.py``); ``default``: no yard (CRIU's
own mounts), ``tuned``: the yard, as every dump now has.

``--knob fast-tar``: CRIU dumps each tmpfs with ``tar --create --gzip`` (GNU tar + gzip)
unless ``belayer_env/host/fast_tar.py``'s helper comes first in its PATH;
``default``: GNU tar, ``tuned``: the helper, as every dump now has when set-up built it.

``--knob loopback-hook``: CRIU runs ``/etc/criu/runc.conf``'s action script at every stage
(``belayer_env/host/loopback.py``); ``default``: the shell script, ``tuned``: the static hook.

One sandbox (``idle`` or ``heavy``, as in checkpoint_bench.py), one store; rounds as in
``_capture_ab.py`` (one capture per variant each, in alternating order).

    python3 benchmarks/frozen_ab.py --knob conntrack --runs 10 --scenarios idle,heavy
Writes benchmarks/results/frozen_ab_<knob>.json and .png; Docker + CRIU, root.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _capture_ab import Variant, parse_args, plot_ab, print_ab, run_rounds, summarize_ab  # noqa: E402
from _plotting import save_result  # noqa: E402
from restore_ab import hook_knob  # noqa: E402

from belayer_env.criu import cgroup_yard, runtime  # noqa: E402
from belayer_env.host import conntrack, fast_tar, loopback  # noqa: E402
from belayer_env.sandbox.docker_api import connect  # noqa: E402
from belayer_env.store.store import CheckpointStore  # noqa: E402

VARIANTS = ("default", "tuned")
DEFAULT_BUCKETS = 262144


def resize(n: int) -> None:
    conntrack.BUCKETS_PATH.write_text(f"{n}\n")
    assert conntrack.buckets() == n, f"the kernel kept {conntrack.buckets()} buckets, not {n}"


def set_switch(name: str, on: bool) -> None:
    setattr(runtime, name, on)


def switch_variants(name: str) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """A ``runtime`` on/off switch: ``default`` off, ``tuned`` on; put back as found."""
    found = getattr(runtime, name)
    return ({"default": partial(set_switch, name, False), "tuned": partial(set_switch, name, True)},
            partial(set_switch, name, found))


def conntrack_knob(result: dict) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    found = conntrack.buckets()
    if found is None:
        raise SystemExit("frozen_ab: this kernel has no conntrack table: nothing to compare")
    sizes = {"default": DEFAULT_BUCKETS, "tuned": conntrack.TARGET_BUCKETS}
    result["knob_detail"] = {"buckets": sizes, "buckets_found": found, "walk_ms_p50": {}}
    for v, n in sizes.items():
        resize(n)
        result["knob_detail"]["walk_ms_p50"][v] = round(statistics.median(conntrack.walk_s() for _ in range(9)) * 1e3, 3)
    print("one conntrack walk, p50: " + ", ".join(
        f"{v} ({sizes[v]}) {ms:.2f} ms" for v, ms in result["knob_detail"]["walk_ms_p50"].items()))
    return {v: partial(resize, n) for v, n in sizes.items()}, partial(resize, found)


def yard_knob(result: dict) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    links = cgroup_yard.hierarchies()
    if not links:
        raise SystemExit("frozen_ab: this host has no cgroup yard (hierarchies not mounted at their roots)")
    result["knob_detail"] = {"yard": dict(links)}
    return switch_variants("CGROUP_YARD")


def fast_tar_knob(result: dict) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    if not fast_tar.installed():
        raise SystemExit(f"frozen_ab: {fast_tar.HELPER} is not installed (bash scripts/setup.sh)")
    result["knob_detail"] = {"helper": str(fast_tar.HELPER)}
    return switch_variants("FAST_TAR")


def loopback_hook_knob(result: dict) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    use, put_back = hook_knob()  # CRIU runs it at four stages of every dump, three inside the freeze
    result["knob_detail"] = {"hook": str(loopback.HOOK_PATH)}
    return {"default": partial(use, False), "tuned": partial(use, True)}, put_back


KNOBS = {"conntrack": conntrack_knob, "cgroup-yard": yard_knob, "fast-tar": fast_tar_knob,
         "loopback-hook": loopback_hook_knob}


def main() -> int:
    args = parse_args(__doc__, "frozen_ab", "default: benchmarks/results/frozen_ab_<knob>.json",
                      lambda ap: ap.add_argument("--knob", required=True, choices=sorted(KNOBS)))
    out = args.out or str(Path(__file__).parent / "results" / f"frozen_ab_{args.knob.replace('-', '_')}.json")
    client = connect()
    run_id = uuid.uuid4().hex[:8]
    work = Path(tempfile.mkdtemp(prefix="belayer-frozen-ab-", dir="/var/tmp"))
    store = CheckpointStore(work / "store", keep=2)
    result = {"host": {"kernel": platform.release(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                       "run_id": run_id}, "knob": args.knob, "runs": args.runs, "scenarios": {}}
    put_back = None
    try:
        prepare, put_back = KNOBS[args.knob](result)
        for scen in args.scenarios.split(","):
            variants = {v: Variant(store, prepare[v]) for v in VARIANTS}
            result["scenarios"][scen] = summarize_ab(run_rounds(client, scen, args.runs, variants, run_id), *VARIANTS)
    finally:
        if put_back is not None:
            put_back()
        shutil.rmtree(work, ignore_errors=True)
    result["host"]["loadavg_end"] = os.getloadavg()
    path = save_result(result, out, partial(plot_ab, variants=VARIANTS, label=args.knob))
    print_ab(result, *VARIANTS)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
