"""Where the time of one ``fork(checkpoint, n)`` goes: a timeline of its parts, per thread.

Wraps (in this process only) the functions ``fork`` spends its time in, records when each
call starts and ends on which thread, runs one capture + ``fork(ck, n)`` per scenario and
prints, per scenario, every span relative to the start of ``fork`` (ms) and the per-part
totals. A diagnostic for docs/checkpoint.md's Fork section, not a benchmark (the wrapping
costs microseconds per call; ``checkpoint_bench.py --fork-only`` gives the figures).

Run: ``python3 benchmarks/fork_profile.py --scenarios idle,heavy --fork-n 8 [--pool [--ahead]]`` (Docker + CRIU, root).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import checkpoint_bench as bench  # noqa: E402

from belayer_env.capture.checkpoint import full_checkpoint  # noqa: E402
from belayer_env.criu import runtime  # noqa: E402
from belayer_env.forks import fork as forking  # noqa: E402
from belayer_env.forks.pool import ForkPool  # noqa: E402
from belayer_env.ops.gc import sweep_shared_layers  # noqa: E402
from belayer_env.restore import prestaging, restore  # noqa: E402
from belayer_env.sandbox import container as sandbox  # noqa: E402
from belayer_env.sandbox import disk  # noqa: E402
from belayer_env.sandbox.docker_api import connect  # noqa: E402
from belayer_env.sandbox.fence import fence  # noqa: E402
from belayer_env.store import in_memory, layer, shared_layer  # noqa: E402
from belayer_env.store.store import CheckpointStore  # noqa: E402

SPANS: list[tuple[str, str, float, float]] = []
_lock = threading.Lock()


def _wrap(owner: object, attr: str, label: str | None = None) -> None:
    fn = getattr(owner, attr, None)
    if fn is None or getattr(fn, "_profiled", False):
        return
    name = label or attr

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                SPANS.append((threading.current_thread().name, name, t0, time.monotonic()))

    timed._profiled = True  # type: ignore[attr-defined]
    setattr(owner, attr, timed)


def instrument() -> None:
    for owner, attr, label in [
        (forking.shared_layer, "sweep", "sweep shared"), (forking, "verified_images", "images verify (once)"),
        (shared_layer, "_make", "shared layer make"), (layer, "install", "  layer unpack+hash"),
        (in_memory, "try_mount_tmpfs", "tmpfs mount"), (getattr(shared_layer, "Making", None), "wait_ready", "wait shared ready"),
        (prestaging, "clean_dead_staging", "clean dead staging"), (prestaging, "docker_tmp", "docker_tmp"),
        (prestaging, "docker_root", "docker_root"),
        (restore, "_link_all", "images hardlink"), (restore, "create_container", "create (+cap)"),
        (sandbox, "limit_layer", "  disk cap"), (disk, "_run", "    mkfs/mount"),
        (shared_layer.SharedLower, "attach", "attach shared"), (restore, "_fence_all_but", "fence list+kill"),
        (runtime, "start_from", "start?checkpoint"), (restore, "_wait_running", "wait running"),
        (restore, "_create", "_create"), (restore.fence, "remove_in_background", "fenced removal"),
        (restore.DockerSandbox, "attach", "DockerSandbox.attach"),
    ]:
        _wrap(owner, attr, label)
    orig_restore = forking.full_restore

    def full_restore(*a, **kw):
        t0 = time.monotonic()
        try:
            return orig_restore(*a, phase_hook=lambda ph: _mark(f"phase {ph}"), **kw)
        finally:
            with _lock:
                SPANS.append((threading.current_thread().name, "full_restore", t0, time.monotonic()))

    forking.full_restore = full_restore


def _mark(label: str) -> None:
    t = time.monotonic()
    with _lock:
        SPANS.append((threading.current_thread().name, label, t, t))


def report(t0: float, total: float, quiet: bool = False) -> None:
    print(f"  fork total {total * 1e3:.0f} ms")
    by_thread: dict[str, list] = {}
    for th, label, a, b in sorted(SPANS, key=lambda s: s[2]):
        by_thread.setdefault(th, []).append((label, a, b))
    for th, spans in sorted(by_thread.items()) if not quiet else ():
        print(f"  [{th}]")
        for label, a, b in spans:
            dur = f"{(b - a) * 1e3:7.1f}" if b > a else "      ."
            print(f"    {(a - t0) * 1e3:7.1f} -> {(b - t0) * 1e3:7.1f}  {dur} ms  {label}")
    totals: dict[str, list[float]] = {}
    for _, label, a, b in SPANS:
        if b > a:
            totals.setdefault(label, []).append(b - a)
    print("  per part: count, sum, max (ms)")
    for label, ds in sorted(totals.items(), key=lambda kv: -max(kv[1])):
        print(f"    {label:24} {len(ds):3d} {sum(ds) * 1e3:8.1f} {max(ds) * 1e3:8.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="idle,heavy")
    ap.add_argument("--fork-n", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=None, help="fork(..., parallel=) (default: fork's own)")
    ap.add_argument("--pool", action="store_true", help="into a ForkPool of fork-n containers filled ahead")
    ap.add_argument("--ahead", action="store_true",
                    help="with --pool: the pool verified the checkpoint's layer and images ahead (ForkPool.prepare)")
    ap.add_argument("--quiet", action="store_true", help="per-part totals only, no timeline")
    args = ap.parse_args()
    if args.ahead and not args.pool:
        ap.error("--ahead needs --pool (the pool holds what it verified ahead)")
    instrument()
    client = connect()
    run_id = uuid.uuid4().hex[:8]
    store_dir = Path(tempfile.mkdtemp(prefix="belayer-forkprof-", dir="/var/tmp"))
    store = CheckpointStore(store_dir, keep=2)
    try:
        for scen in args.scenarios.split(","):
            profile(client, store, scen, run_id, args)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    return 0


def profile(client, store: CheckpointStore, scen: str, run_id: str, args: argparse.Namespace) -> None:
    """``args.rounds`` x (a step, a capture, ``fork(ck, n)`` timed and reported, clean-up)."""
    sb = bench.bench_sandbox(client, scen, run_id)
    try:
        for i in range(args.rounds):
            sb.execute(bench.STEP.format(i=i))
            ck = full_checkpoint(sb, store)
            kw = {"parallel": args.parallel} if args.parallel else {}
            pool = ForkPool(sb, args.fork_n) if args.pool else None
            if pool is not None:  # filled ahead, untimed, as an env's ``fork_pool``
                pool.fill()
                if args.ahead:  # as an env's ``fork_pool`` does when a checkpoint is published
                    bench.prepare_ahead(pool, ck)
                assert pool.wait_filled(), f"the fork pool did not fill: {pool.error}"
                bench.settle()
                kw["pool"] = pool
            SPANS.clear()
            t0 = time.monotonic()
            try:
                forks = forking.fork(ck, args.fork_n, client=client, **kw)
            finally:
                if pool is not None:
                    pool.close()
            total = time.monotonic() - t0
            print(f"\n{scen} round {i + 1}: checkpoint {ck.size_bytes / 1e6:.1f} MB")
            report(t0, total, args.quiet)
            for f in forks:
                assert f.is_alive(), f.name
                fence(client, f.name, background=False)
            sweep_shared_layers(client)
    finally:
        fence(client, sb.name, background=False)


if __name__ == "__main__":
    sys.exit(main())
