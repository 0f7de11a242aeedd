"""The run's one config object, ``RunConfig``, and the parts it nests (torch-free).

The orchestrator hands this object to the learner process as it is; ``belayer demo``
derives its flags from it (``--steps``, ``--faults-env-rate``, ``--learner-sft-steps`` ...).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_CONFIG = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class AgentConfig(BaseModel):
    """Sampling and episode bounds (short: bytes are tokens for the embedded model)."""

    model_config = _CONFIG

    model: str = "belayer-default"
    """Model name sent to the OpenAI endpoint."""
    max_tokens: int = Field(default=48, ge=1)
    """Token budget of one assistant message."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the rollouts."""
    max_turns: int = Field(default=4, ge=1)
    """Commands per episode."""
    command_timeout_s: float = Field(default=10.0, gt=0)
    """Timeout of one command in the sandbox (and of the reward's test run)."""
    checkpoint_policy: Literal["adaptive", "always", "never"] = "adaptive"
    """When the env checkpoints the sandbox at a step boundary."""
    standby: bool = True
    """Keep the newest checkpoint pre-restored in a frozen standby when the adaptive policy
    finds it worth its memory and CPU: a rollback onto it is a thaw, not a restore."""
    restore_spare: bool = True
    """Keep one container created ahead per env for its next restore (no memory; refilled in
    the background): a rollback without a standby skips Docker's create."""
    recover_while_idle: bool = True
    """Restore a sandbox that dies while the model generates at once, in the background: the
    next command then runs on the restored sandbox (``EnvConfig.recover_while_idle``)."""


class LearnerConfig(BaseModel):
    model_config = _CONFIG

    seed: int = 0
    """Seed of the initial weights (must equal the arena's, so both start identical)."""
    sft_lr: float = 3e-3
    """Learning rate of the supervised warm start."""
    sft_steps: int = Field(default=17, ge=0)
    """Warm-start iterations: stops at partial success (~0.3 at temperature 1), so RL has signal."""
    sft_batch: int = Field(default=8, ge=1)
    """Expert episodes per warm-start iteration."""
    rl_lr: float = 3e-4
    """Learning rate of the GRPO updates."""
    epochs: int = Field(default=4, ge=1)
    """Clipped policy-gradient epochs per batch (1 = plain on-policy REINFORCE with a group baseline)."""
    clip: float = 0.2
    """PPO-style ratio clip."""
    temperature: float = Field(default=1.0, gt=0)
    """The rollouts' sampling temperature: RL log-probs are those of softmax(logits / T)."""
    chunk_tokens: int = Field(default=8192, ge=1)
    """Tokens per forward/backward chunk (gradients accumulate across chunks)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    loss_agg: Literal["episode", "token"] = "episode"
    """"episode": every episode weighs the same (its tokens' mean); "token": every generated
    token does (long failed episodes then dominate the batch and push the policy apart)."""


class FaultConfig(BaseModel):
    """What is killed during the run, and how often."""

    model_config = _CONFIG

    env_rate: float = Field(default=0.05, ge=0, le=1)
    """Probability that a given env step gets a container fault."""
    env_kinds: list[str] = Field(default_factory=lambda: ["kill", "oom"])
    """Container faults to draw from (kinds of ``FaultInjection``)."""
    env_window_s: float = Field(default=1.5, ge=0)
    """An env fault fires at a uniformly random instant this many seconds from its step's start
    (about one step cycle here: the command, then the model generating the next one): host,
    runtime and daemon failures arrive in wall-clock time, not only while a command runs.
    0.2 puts nearly every fault inside the command (this run's placement until 2026-12-02)."""
    worker_rate_per_min: float = Field(default=2.0, ge=0)
    """Mean SIGKILLs of the inference worker per minute of rollout time (0: none)."""
    worker_min_gap_s: float = Field(default=12.0, ge=0)
    """Least seconds between two kills; each also waits until the last handover is older than the
    supervisor's unhealthy window (a kill sooner would, rightly, exclude the device)."""
    worker_first_kill_s: float | None = Field(default=None, ge=0)
    """Fixed delay of the first worker kill (a short run then surely sees one); none = random."""
    learner_kill_steps: list[int] = Field(default_factory=lambda: [3])
    """Steps at whose boundary the learner process is SIGKILLed while its checkpoint is being
    saved; it resumes from the newest complete one."""


class RunConfig(BaseModel):
    """One training run: the orchestrator, the learner process and ``belayer demo`` read it."""

    model_config = _CONFIG

    out_dir: str = "belayer-demo"
    """Output directory: event log, learner checkpoints, summary, plot."""
    steps: int = Field(default=8, ge=1)
    """GRPO steps."""
    n_tasks: int = Field(default=8, ge=2)
    """Toy repos in the task set."""
    tasks_per_step: int = Field(default=8, ge=1)
    """Tasks sampled (from the task set) per step."""
    group_size: int = Field(default=4, ge=2)
    """Episodes per task and step (one GRPO group)."""
    parallel: int = Field(default=8, ge=1)
    """Episodes rolled out concurrently."""
    seed: int = 0
    """Seed of the task set, the rollouts and the fault schedule."""
    threads: int = Field(default=2, ge=1)
    """Torch threads of the learner process."""
    max_learner_restarts: int = Field(default=5, ge=0)
    """Unplanned learner exits tolerated before the run fails."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.tasks_per_step > self.n_tasks:
            raise ValueError(f"tasks_per_step ({self.tasks_per_step}) exceeds n_tasks ({self.n_tasks})")
        if self.agent.temperature != self.learner.temperature:
            raise ValueError("agent.temperature and learner.temperature must be equal (the learner "
                             "scores the rollouts' tokens under the temperature they were sampled at)")
        return self
