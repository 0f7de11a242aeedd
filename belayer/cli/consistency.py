"""``belayer consistency``: run the consistency harness (real faults, real containers).

Exit 0 only when every trial converged to the golden state with each effect applied
exactly once; every counterexample is printed (or listed in ``--json``).
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("consistency", help="fault-inject N trials and check prefix consistency",
                       description="Run a scripted workload fault-free (golden), then N trials with one "
                                   "fail-stop each (during an action, a checkpoint or a restore); every "
                                   "trial must reach the golden file system and runtime state.")
    p.add_argument("--trials", type=int, default=30, help="number of faulty trials (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (default 0)")
    p.add_argument("--checkpoint-every", type=int, default=2, metavar="K",
                   help="checkpoint every K-th action boundary (default 2)")
    p.add_argument("--standby", action="store_true",
                   help="keep a standby sandbox (pre-restored, frozen); faults also hit its preparation and thaw")
    p.add_argument("--spare", action="store_true",
                   help="keep a restore spare (a container created ahead): restores, and their faults, start in it")
    p.add_argument("--recover-while-idle", action="store_true",
                   help="restore a sandbox that dies between actions in the background; faults also hit it "
                        "while the scripted agent thinks")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="trials at once, each in its own sandbox (default 1; the fault schedule is the seed's)")
    p.add_argument("--out", metavar="FILE", help="append each trial as a JSON line to FILE (long runs)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from belayer_core.errors import UsageError
    from belayer_env.consistency import run_consistency

    if args.trials < 1 or args.checkpoint_every < 1 or args.jobs < 1:
        raise UsageError("--trials, --checkpoint-every and --jobs must be >= 1")

    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - closed below

    def progress(r) -> None:
        if out is not None:
            out.write(r.model_dump_json() + "\n")
            out.flush()
        if not args.json:
            mark = "ok  " if r.ok else "FAIL"
            where = f"{r.fault.where}:{r.fault.kind}@{r.fault.step}" + (f"/{r.fault.phase}" if r.fault.phase else "")
            print(f"[{mark}] trial {r.trial:>4}  {where:<34} rollbacks={r.rollbacks} {r.duration_s:.1f}s",
                  file=sys.stdout, flush=True)
            for p in r.problems:
                print(f"       {p}")

    try:
        report = run_consistency(args.trials, seed=args.seed, checkpoint_every=args.checkpoint_every,
                                 standby=args.standby, spare=args.spare, idle=args.recover_while_idle,
                                 jobs=args.jobs, progress=progress)
    finally:
        if out is not None:
            out.close()
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        print(f"{report.passed}/{report.trials} trials consistent, {len(report.counterexamples)} "
              f"counterexamples; faults fired {report.faults_fired}, rollbacks {report.rollbacks}, "
              f"by where {report.by_where}, {report.total_s:.0f}s")
    return 0 if not report.counterexamples else 1
