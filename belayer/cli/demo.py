"""``belayer demo``: a short SWE agent RL run with injected faults (belayer/examples/swe_rl).

Its options are the fields of the example's ``RunConfig`` (``--steps``,
``--faults-env-rate``, ``--learner-sft-steps`` ...). Live progress goes to stdout (to
stderr with ``--json``, which prints one JSON summary).
"""

from __future__ import annotations

import argparse
import json
import sys

from belayer.examples.swe_rl.config import RunConfig
from belayer_core.config_flags import ConfigFlags

# the initial weights' seed must be the arena's (both start identical), so it is not an option
FLAGS = ConfigFlags(RunConfig, exclude=("learner.seed",), title="run (RunConfig)")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="SWE agent RL training with injected env/worker/learner faults, end to end",
        description="Warm start + GRPO of the embedded model on toy SWE repos in real sandboxes, "
                    "while containers, the inference worker and the learner process are killed.")
    p.add_argument("--json", action="store_true", help="print one JSON summary on stdout")
    FLAGS.add_to(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from belayer.examples.swe_rl.run import run as run_training

    cfg = FLAGS.build(args)
    stream = sys.stderr if args.json else sys.stdout

    def display(line: str) -> None:
        print(line, file=stream, flush=True)

    summary = run_training(cfg, display)
    if args.json:
        print(json.dumps(summary))
    else:
        display(json.dumps({k: v for k, v in summary.items() if k != "reward_by_step"}, indent=1))
    return 0
