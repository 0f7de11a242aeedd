"""``python -m belayer.examples.trl_grpo``: the run's flags (``--help``) and its summary.

Run it with TRL's venv python: ``/opt/belayer/trl-venv/bin/python -m belayer.examples.trl_grpo``
(``bash scripts/setup_trl.sh`` makes it). Exit status 0 only when every fault was recovered,
no sample was lost and none mixes weight versions.
"""

from __future__ import annotations

import argparse
import sys

from belayer.wrappers.infra_policy import InfraPolicy

from .episode import EpisodeConfig
from .run import RunConfig, main


def parse(argv: list[str] | None = None) -> tuple[RunConfig, bool]:
    d, e = RunConfig(), EpisodeConfig()
    p = argparse.ArgumentParser(prog="python -m belayer.examples.trl_grpo", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=d.steps, help="GRPO optimizer steps (one rollout batch each)")
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step, help="distinct tasks per step")
    p.add_argument("--group-size", type=int, default=d.group_size, help="episodes per task (TRL's num_generations)")
    p.add_argument("--lr", type=float, default=d.lr, help="GRPO learning rate")
    p.add_argument("--sft-steps", type=int, default=d.sft_steps, help="warm-start steps on the expert (0: none)")
    p.add_argument("--sft-lr", type=float, default=d.sft_lr)
    p.add_argument("--container-kills-per-step", type=int, default=d.container_kills_per_step,
                   help="episodes per step whose container is SIGKILLed while the model writes turn 2")
    p.add_argument("--worker-kills-per-step", type=int, default=d.worker_kills_per_step,
                   help="episodes per step whose turn-1 generation loses its worker to a SIGKILL")
    p.add_argument("--beyond-recovery-per-step", type=int, default=d.beyond_recovery_per_step,
                   help="episodes per step whose container is SIGKILLed with every restore failing (the "
                        "infrastructure policy restarts them in a fresh sandbox)")
    p.add_argument("--infra-retries", type=int, default=e.infra.retries,
                   help="fresh sandboxes an episode may start over in before it is dropped with its group")
    p.add_argument("--turns", type=int, default=e.turns, help="model turns per episode")
    p.add_argument("--max-new-tokens", type=int, default=e.max_new_tokens, help="per turn")
    p.add_argument("--temperature", type=float, default=e.temperature)
    p.add_argument("--checkpoint-policy", default=e.checkpoint_policy, choices=["always", "adaptive", "never"],
                   help="the env's checkpoint policy (CRIU + file system, at action boundaries)")
    p.add_argument("--parallel", type=int, default=d.parallel, help="episodes rolled out at once")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads of the trainer")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", action="store_true", help="print only the summary, as one JSON line (progress on stderr)")
    a = p.parse_args(argv)
    episode = EpisodeConfig(turns=a.turns, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                            checkpoint_policy=a.checkpoint_policy, infra=InfraPolicy(retries=a.infra_retries))
    cfg = RunConfig(steps=a.steps, prompts_per_step=a.prompts_per_step, group_size=a.group_size, lr=a.lr,
                    sft_steps=a.sft_steps, sft_lr=a.sft_lr, container_kills_per_step=a.container_kills_per_step,
                    worker_kills_per_step=a.worker_kills_per_step,
                    beyond_recovery_per_step=a.beyond_recovery_per_step, parallel=a.parallel, threads=a.threads,
                    seed=a.seed, episode=episode)
    return cfg, a.json


if __name__ == "__main__":
    cfg, as_json = parse()
    sys.exit(main(cfg, as_json))
