"""``python -m belayer.examples.trl_grpo``: the run's flags (``--help``) and its summary.

Run it with TRL's venv python: ``/opt/belayer/trl-venv/bin/python -m belayer.examples.trl_grpo``
(``bash scripts/setup_trl.sh`` makes it). Exit status 0 only when every fault was recovered,
no sample was lost and none mixes weight versions.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from belayer.wrappers.infra_policy import InfraPolicy

from .episode import EpisodeConfig
from .run import RunConfig, main

# --mode environment_factory: the random model must learn TRL's tool-call JSON (~1,260 byte
# tokens a task) before it calls a tool; 100 steps on one task do (loss 8.7 -> 0.001)
ENV_DEFAULTS = {"tasks": 1, "prompts_per_step": 1, "sft_steps": 100, "max_new_tokens": 128}


def parse(argv: list[str] | None = None) -> tuple[RunConfig, bool]:
    d, e = RunConfig(), EpisodeConfig()
    p = argparse.ArgumentParser(prog="python -m belayer.examples.trl_grpo", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=d.steps, help="GRPO optimizer steps (one rollout batch each)")
    p.add_argument("--prompts-per-step", type=int, default=None,
                   help=f"distinct tasks per step (default: {d.prompts_per_step}; {ENV_DEFAULTS['prompts_per_step']} "
                        "with --mode environment_factory)")
    p.add_argument("--tasks", type=int, default=None,
                   help=f"the first this many tasks make the dataset (default: {d.tasks}; {ENV_DEFAULTS['tasks']} "
                        "with --mode environment_factory)")
    p.add_argument("--group-size", type=int, default=d.group_size, help="episodes per task (TRL's num_generations)")
    p.add_argument("--lr", type=float, default=d.lr, help="GRPO learning rate")
    p.add_argument("--sft-steps", type=int, default=None,
                   help=f"warm-start steps on the expert, 0: none (default: {d.sft_steps}; "
                        f"{ENV_DEFAULTS['sft_steps']} with --mode environment_factory)")
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
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"per turn (default: {e.max_new_tokens}; {ENV_DEFAULTS['max_new_tokens']} with --mode "
                        "environment_factory, a JSON tool call)")
    p.add_argument("--temperature", type=float, default=e.temperature)
    p.add_argument("--checkpoint-policy", default=e.checkpoint_policy, choices=["always", "adaptive", "never"],
                   help="the env's checkpoint policy (CRIU + file system, at action boundaries)")
    p.add_argument("--parallel", type=int, default=d.parallel, help="episodes rolled out at once")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads of the trainer")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--mode", choices=["rollout_func", "environment_factory"], default=d.mode,
                   help="rollout_func: each rollout a Belayer episode; environment_factory: TRL's tool-calling loop "
                        "over a SandboxEnvironment, the engine generating")
    p.add_argument("--json", action="store_true", help="print only the summary, as one JSON line (progress on stderr)")
    a = p.parse_args(argv)
    defaults = {**asdict(d), "max_new_tokens": e.max_new_tokens}
    if a.mode == "environment_factory":
        defaults.update(ENV_DEFAULTS)
    for name in ENV_DEFAULTS:
        if getattr(a, name) is None:
            setattr(a, name, defaults[name])
    episode = EpisodeConfig(turns=a.turns, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                            checkpoint_policy=a.checkpoint_policy, infra=InfraPolicy(retries=a.infra_retries))
    cfg = RunConfig(steps=a.steps, prompts_per_step=a.prompts_per_step, tasks=a.tasks, group_size=a.group_size, lr=a.lr,
                    sft_steps=a.sft_steps, sft_lr=a.sft_lr, container_kills_per_step=a.container_kills_per_step,
                    worker_kills_per_step=a.worker_kills_per_step,
                    beyond_recovery_per_step=a.beyond_recovery_per_step, parallel=a.parallel, threads=a.threads,
                    seed=a.seed, mode=a.mode, episode=episode)
    return cfg, a.json


if __name__ == "__main__":
    cfg, as_json = parse()
    sys.exit(main(cfg, as_json))
