"""``belayer demo``: a short SWE agent RL run with injected faults (examples/swe_rl).

Live progress goes to stdout (to stderr with ``--json``, which prints one JSON summary).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="SWE agent RL training with injected env/worker/learner faults, end to end",
        description="Warm start + GRPO of the embedded model on toy SWE repos in real sandboxes, "
                    "while containers, the inference worker and the learner process are killed.")
    p.add_argument("--steps", type=int, default=8, help="GRPO steps (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON summary on stdout")
    p.add_argument("--out", default="belayer-demo", help="output dir: events, checkpoints, plot")
    p.add_argument("--fault-rate", type=float, default=0.05,
                   help="per-step probability of an env container fault (kill/OOM), default 0.05")
    p.add_argument("--worker-kills-per-min", type=float, default=2.0,
                   help="mean SIGKILLs of the inference worker per minute (0: none)")
    p.add_argument("--learner-kill-steps", default="3",
                   help="comma-separated steps at whose boundary the learner process is SIGKILLed "
                        "while its checkpoint is being saved; it resumes from the newest complete one ('': none)")
    p.add_argument("--group-size", type=int, default=4, help="samples per task (GRPO group)")
    p.add_argument("--tasks-per-step", type=int, default=8, help="tasks per step (of 8)")
    p.add_argument("--sft-steps", type=int, default=17, help="supervised warm-start iterations")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from belayer.errors import UsageError
    from examples.swe_rl.faults import FaultConfig
    from examples.swe_rl.run import RunConfig
    from examples.swe_rl.run import run as run_training

    try:
        kill_steps = [int(s) for s in args.learner_kill_steps.split(",") if s.strip()]
        cfg = RunConfig(out_dir=args.out, steps=args.steps, group_size=args.group_size,
                        tasks_per_step=args.tasks_per_step, sft_steps=args.sft_steps, seed=args.seed,
                        faults=FaultConfig(env_rate=args.fault_rate, worker_rate_per_min=args.worker_kills_per_min,
                                           learner_kill_steps=kill_steps, seed=args.seed))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    stream = sys.stderr if args.json else sys.stdout

    def display(line: str) -> None:
        print(line, file=stream, flush=True)

    summary = run_training(cfg, display)
    if args.json:
        print(json.dumps(summary))
    else:
        display(json.dumps({k: v for k, v in summary.items() if k != "reward_by_step"}, indent=1))
    return 0
