"""SkyRL's env interface (skyrl-gym >= 0.4) over ``RecoverableSandboxEnv``.

``RecoverableSkyRLEnv`` is a ``skyrl_gym`` text env (``BaseTextEnv``: ``init(prompt)``,
``step(action) -> dict``, ``close``, ``get_metrics``): each turn the model's output is one
action; its last fenced bash block (or the whole text) runs as one command in a real
container, and the command's output comes back as a user message::

    from belayer.wrappers.skyrl import register
    register()   # then skyrl_gym.make("belayer-sandbox", env_config=..., extras=...)

``env_config`` (SkyRL's ``environment.skyrl_gym.belayer-sandbox``): ``EnvConfig`` fields
plus ``checkpoint_policy``. Per-sample ``extras`` follow SkyRL's dataset columns:
``reward_spec.test_command`` (reward 1.0 when it exits 0 at submit), ``extra_info.setup``
(command(s) run in the fresh sandbox), ``extra_info.image``, and ``max_turns`` (set by
SkyRL's generator).

Recovery: an infrastructure failure during a turn restores boundary j and returns
``observations=[]``, ``done=False`` and ``metadata["belayer"]["rollback"] = {"to_step": j,
"reason": ...}``; the infra error never becomes an observation. The sandbox is then at the
state after turn j: a generator keeps the first j turns of its conversation (model output +
observation each) and regenerates from there. SkyRL's stock ``SkyRLGymGenerator`` does not
cut its token history; with it, drop episodes whose ``get_metrics()["env_rollbacks"]`` is
non-zero, or cut in your generator. Infrastructure failures follow
``belayer.wrappers.infra_policy`` (``env_config`` key ``infra``: ``InfraPolicy`` fields): when
the env's recovery is exhausted the sample restarts in a fresh sandbox, reported as a rollback
to boundary 0 (``"fresh_sandbox": n``; the generator keeps no turn and regenerates from the
prompt); past the policy's retries ``step`` raises ``SampleDropped`` (an ``InfraError``): no
sample, never reward 0; drop its group with it. skyrl_gym is imported when the class is first
used, not at import.
"""

from __future__ import annotations

import functools
from typing import Any

ENV_ID = "belayer-sandbox"
SETUP_HINT = "pip install skyrl-gym (set-up: bash scripts/setup_skyrl.sh)"


def register(env_id: str = ENV_ID) -> str:
    """Register the env with skyrl_gym under ``env_id`` (idempotent); returns the id."""
    skyrl_gym = _skyrl_gym()
    if env_id not in skyrl_gym.envs.registration.registry:
        skyrl_gym.register(id=env_id, entry_point=f"{__name__}:RecoverableSkyRLEnv")
    return env_id


def __getattr__(name: str) -> Any:
    if name == "RecoverableSkyRLEnv":
        return _env_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _skyrl_gym() -> Any:
    try:
        import skyrl_gym
    except ImportError as e:
        raise ImportError(f"belayer.wrappers.skyrl needs skyrl-gym: {SETUP_HINT}") from e
    return skyrl_gym


def _plain(value: Any) -> dict[str, Any]:
    """A dict from SkyRL's config (an omegaconf ``DictConfig``) or a mapping; None -> {}."""
    if value is None:
        return {}
    if type(value).__name__ == "DictConfig":
        from omegaconf import OmegaConf  # a skyrl_gym dependency

        return OmegaConf.to_container(value, resolve=True)
    return dict(value)


@functools.cache
def _env_class() -> type:
    _skyrl_gym()
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

    from belayer.wrappers.chat_history import parse_bash_block
    from belayer.wrappers.infra_policy import InfraPolicy, PolicyEnv
    from belayer_env import RecoverableSandboxEnv
    from belayer_env.env import CommandReward, EnvConfig

    class RecoverableSkyRLEnv(BaseTextEnv):
        def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
            super().__init__()
            config, extras = _plain(env_config), dict(extras or {})
            policy = config.pop("checkpoint_policy", "adaptive")
            infra = InfraPolicy(**_plain(config.pop("infra", None)))
            if "max_turns" in extras and "max_steps" not in config:
                config["max_steps"] = int(extras["max_turns"])
            self.max_turns = int(config.get("max_steps") or extras.get("max_turns") or 1 << 30)
            info, reward_spec = _plain(extras.get("extra_info")), _plain(extras.get("reward_spec"))
            self._options = {k: info[k] for k in ("setup", "image") if info.get(k) is not None}
            test = reward_spec.get("test_command")
            self.env = RecoverableSandboxEnv(EnvConfig(**config), checkpoint_policy=policy,
                                             reward=CommandReward(test) if test else None)
            self.policy_env = PolicyEnv(self.env, infra)
            self.rollbacks: list[dict[str, Any]] = []

        def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
            """Start the episode's sandbox (its setup run); the prompt is returned unchanged."""
            task = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
            self.policy_env.reset(options={"task": str(task), **self._options})
            self.turns, self.rollbacks = 0, []
            return prompt, {"belayer": {"step": 0}}

        def step(self, action: str) -> BaseTextEnvStepOutput:
            command = parse_bash_block(action).replace("\x00", "")  # NUL cannot reach bash
            obs, reward, terminated, truncated, info = self.policy_env.step(command)
            belayer = info["belayer"]
            if "rollback" in belayer:  # the sandbox is at boundary j: turns j+1.. are gone
                self.turns = belayer["rollback"]["to_step"]
                self.rollbacks.append(belayer["rollback"])
                return BaseTextEnvStepOutput(observations=[], reward=0.0, done=False,
                                             metadata={"belayer": belayer}, postprocessed_action=None)
            self.turns = belayer["step"]
            done = terminated or truncated or self.turns >= self.max_turns
            metadata = {"belayer": belayer, "returncode": info.get("returncode")}
            if "submission" in info:
                metadata["submission"] = info["submission"]
            return BaseTextEnvStepOutput(observations=[] if done else [{"role": "user", "content": obs}],
                                         reward=float(reward), done=done, metadata=metadata,
                                         postprocessed_action=None)

        def get_metrics(self) -> dict[str, Any]:
            return {"steps": self.turns, "env_rollbacks": len(self.rollbacks),
                    "recovered": int(self.env.trajectory.recovered),
                    "fresh_sandbox_retries": len(self.policy_env.attempts)}

        def close(self) -> None:
            self.env.close()

    RecoverableSkyRLEnv.__module__ = __name__  # pickles by reference (module __getattr__)
    RecoverableSkyRLEnv.__qualname__ = "RecoverableSkyRLEnv"
    return RecoverableSkyRLEnv
