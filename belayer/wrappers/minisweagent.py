"""A drop-in for mini-swe-agent's ``DockerEnvironment`` with prefix-consistent recovery.

Same config fields (image, cwd, env, forward_env, timeout, executable, run_args,
container_timeout, pull_timeout, interpreter) and the same methods (``execute``,
``get_template_vars``, ``serialize``, ``cleanup``), so an agent switches by config::

    environment:
      environment_class: belayer.wrappers.minisweagent.RecoverableDockerEnvironment
      image: belayer-base:latest

mini-swe-agent is not imported unless installed (it pulls litellm); the adapter follows
its documented interface (v2: ``execute(action: dict)`` raising ``Submitted``; v1:
``execute(command: str)`` returning the output). On a rollback the bound agent's message
list is cut back to the restored boundary and ``RolledBack`` (an ``InterruptAgentFlow``
with no messages, when mini-swe-agent is installed) makes its loop query the model again;
the loop's read of its (empty) messages cuts again, dropping what the agent appended
meanwhile (``InteractiveAgent`` adds the discarded branch's observations in a ``finally``).
Bind the agent with ``env.bind(agent)`` (or give ``agent=``) after building it.

Infrastructure failures follow ``belayer.wrappers.infra_policy`` (config field ``infra``): a
sandbox beyond the env's recovery is replaced by a fresh one and reported as a rollback to
boundary 0 (the agent's context goes back to its first query); past the policy's retries
``execute`` raises ``InfraDropped``, which ends ``agent.run`` with ``exit_status
"InfraDropped"`` and no submission: a trainer takes no sample from that run (and drops its
group), never a reward of 0.
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from belayer.wrappers.infra_policy import InfraPolicy, PolicyEnv, SampleDropped
from belayer_env.env.recoverable import EnvConfig, RecoverableSandboxEnv
from belayer_env.sandbox.config import SandboxConfig

try:  # the real base classes when mini-swe-agent is installed, so its agent loop handles them
    from minisweagent.exceptions import InterruptAgentFlow as _Interrupt
    from minisweagent.exceptions import Submitted as _Submitted
except ImportError:  # pragma: no cover - depends on the environment
    _Interrupt = None
    _Submitted = None


class _Recut:
    """``RolledBack.messages``: empty, but iterating it cuts the agent's messages again (once).

    The adapter cuts when it raises; ``InteractiveAgent.execute_actions`` then appends, in a
    ``finally``, observations of the discarded branch (outputs of the message's actions that
    ran, or tool-call models' "not executed" results). mini-swe-agent's loop iterates this
    (``add_messages(*e.messages)``) after that and before the next query: the cut repeats."""

    def __init__(self, messages: list | None = None, keep: int = 0):
        self._messages, self._keep = messages, keep

    def __iter__(self):
        if self._messages is not None:
            del self._messages[self._keep:]
            self._messages = None
        return iter(())

    def __len__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return other == () or isinstance(other, _Recut)


class RolledBack(_Interrupt or Exception):  # type: ignore[misc]
    """The sandbox was restored to boundary ``to_step``; the agent's context was cut to match."""

    def __init__(self, to_step: int, reason: str, messages: _Recut | tuple = ()):
        if _Interrupt is not None:
            super().__init__()
        else:
            super().__init__(f"rolled back to step {to_step} ({reason})")
        self.to_step, self.reason = to_step, reason
        self.messages = messages


class InfraDropped(_Interrupt or Exception):  # type: ignore[misc]
    """The infrastructure policy dropped this run (recovery and fresh sandboxes failed); it ends
    mini-swe-agent's loop with ``exit_status`` "InfraDropped" (its ``messages`` hold the exit)."""

    def __init__(self, dropped: SampleDropped):
        exit_message = {"role": "exit", "content": str(dropped),
                        "extra": {"exit_status": "InfraDropped", "submission": "",
                                  "belayer_dropped": [a["error"] for a in dropped.attempts]}}
        if _Interrupt is not None:
            super().__init__(exit_message)
        else:
            super().__init__(str(dropped))
            self.messages = (exit_message,)


class RecoverableDockerEnvironmentConfig(BaseModel):
    """mini-swe-agent's DockerEnvironmentConfig fields, plus Belayer's own (prefixed)."""

    model_config = ConfigDict(extra="forbid")

    image: str
    cwd: str = "/"
    env: dict[str, str] = Field(default_factory=dict)
    forward_env: list[str] = Field(default_factory=list)
    timeout: int = 30
    executable: str = os.getenv("MSWEA_DOCKER_EXECUTABLE", "docker")
    """Accepted for compatibility; Belayer talks to the daemon through the docker SDK."""
    run_args: list[str] = Field(default_factory=lambda: ["--rm"])
    """Accepted for compatibility; creation settings come from the sandbox config."""
    container_timeout: str = "2h"
    pull_timeout: int = 120
    interpreter: list[str] = Field(default_factory=lambda: ["bash", "-lc"])
    checkpoint_policy: str = "adaptive"
    memory: str = "1g"
    network: bool = False
    infra: InfraPolicy = Field(default_factory=InfraPolicy)
    """What happens when the env's recovery is exhausted (fresh sandboxes, then ``InfraDropped``)."""


class RecoverableDockerEnvironment:
    def __init__(self, *, config_class: type = RecoverableDockerEnvironmentConfig,
                 logger: logging.Logger | None = None, agent: Any = None, **kwargs: Any):
        self.logger = logger or logging.getLogger("belayer.minisweagent")
        self.config = config_class(**kwargs)
        c = self.config
        env_vars = {k: v for k in c.forward_env if (v := os.getenv(k)) is not None} | c.env
        sandbox = SandboxConfig(image=c.image, cwd=c.cwd, env=env_vars, timeout=float(c.timeout),
                                memory=c.memory, network=c.network)
        self.env = RecoverableSandboxEnv(EnvConfig(sandbox=sandbox), checkpoint_policy=c.checkpoint_policy)
        self.policy_env = PolicyEnv(self.env, c.infra)
        self.dropped: list[str] | None = None
        self.policy_env.reset()
        self.agent = agent
        self._prefix: dict[int, int] = {}  # boundary j -> len(agent.messages) at j
        self._message_id: int | None = None
        self._done_in_message = 0

    @property
    def container_id(self) -> str | None:
        return self.env.sandbox.container_id if self.env.sandbox else None

    def bind(self, agent: Any) -> None:
        """Give the adapter the agent whose ``messages`` it rolls back."""
        self.agent = agent

    # ------------------------------------------------------------------ mini-swe-agent API

    def execute(self, action: dict | str, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "") if isinstance(action, dict) else action
        command = self._wrap(command)
        last_of_message = self._track_message()
        try:
            obs, _r, terminated, _t, info = self.policy_env.step_command(command, cwd=cwd, timeout=timeout,
                                                                         checkpoint=last_of_message)
        except SampleDropped as e:
            self.dropped = [a["error"] for a in e.attempts]
            raise InfraDropped(e) from e
        rollback = info["belayer"].get("rollback")
        if rollback is not None:
            recut = self._roll_back(rollback["to_step"])
            raise RolledBack(rollback["to_step"], rollback["reason"], recut)
        output = {"output": self.env.last_result["output"], "returncode": info["returncode"],
                  "exception_info": ""}
        if terminated and _Submitted is not None and isinstance(action, dict):
            submission = info.get("submission", "")
            raise _Submitted({"role": "exit", "content": submission,
                              "extra": {"exit_status": "Submitted", "submission": submission}})
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return self.config.model_dump() | platform.uname()._asdict() | kwargs

    def serialize(self) -> dict:
        trajectory = self.env.trajectory
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json"),
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}"},
            "belayer": {"recovered": trajectory.recovered,
                        "events": [e.model_dump(mode="json") for e in trajectory.events],
                        "dropped": self.dropped, **self.policy_env.label()}}}

    def cleanup(self) -> None:
        self.env.close()

    close = cleanup

    def __del__(self) -> None:
        env = getattr(self, "env", None)
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    # ------------------------------------------------------------------ prefix bookkeeping

    def _wrap(self, command: str) -> str:
        if self.config.interpreter[:2] == ["bash", "-lc"]:
            return command
        import shlex

        return shlex.join([*self.config.interpreter, command])

    def _track_message(self) -> bool:
        """Record boundary -> message count; True when this is the message's last action."""
        messages = getattr(self.agent, "messages", None)
        if not messages:
            return True
        message = messages[-1]
        if id(message) != self._message_id:
            self._message_id, self._done_in_message = id(message), 0
            self._prefix[len(self.env.trajectory.steps)] = len(messages) - 1
        self._done_in_message += 1
        actions = (message.get("extra") or {}).get("actions") or [None]
        return self._done_in_message >= len(actions)

    def _roll_back(self, j: int) -> _Recut:
        messages = getattr(self.agent, "messages", None)
        self._message_id = None
        if messages is None:
            return _Recut()
        cut = self._prefix.get(j)
        if cut is None:  # only message ends are checkpointed, so this is boundary 0's fallback
            cut = self._prefix.get(0, len(messages))
        del messages[cut:]
        for b in [b for b in self._prefix if b > j]:
            del self._prefix[b]
        return _Recut(messages, cut)

