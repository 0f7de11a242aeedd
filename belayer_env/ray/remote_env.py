"""``RemoteSandboxEnv``: the driver's handle of one episode on a Ray cluster, node loss included.

A Gymnasium env whose sandbox lives in a ``SandboxEnvActor`` on some node. It keeps what
resuming needs on the driver side: the reset options, the committed boundary ``k`` and the
newest replicated checkpoint ``j`` the actor reported. When the actor (its node) is lost
during a call, a new actor is placed on a node with a free sandbox slot and resumes the
episode from ``j``; the call returns that boundary's observation with
``info["belayer"]["rollback"] = {"to_step": j, "reason": "NodeLost"}``, exactly as the env
reports its own rollbacks. The lost call's action is never retried: the agent regenerates
from ``j``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import gymnasium as gym
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from belayer_core.errors import InfraError, NodeLost, UsageError
from belayer_env.ray.actor import actor_class
from belayer_env.ray.config import RayEnvConfig


class RemoteSandboxEnv(gym.Env[str, str]):
    metadata = {"render_modes": []}

    def __init__(self, config: RayEnvConfig, *, spaces: tuple[Any, Any] | None = None):
        self.config = config
        self._cls = actor_class(config)
        self.actor: Any = None
        self.where: dict[str, Any] = {}
        """Node id, pid and host of the current actor."""
        self.options: dict[str, Any] | None = None
        self.step_count = 0
        """The committed boundary the agent is at (what a lost node rolls back from)."""
        self.resume_point: dict[str, Any] | None = None
        """Newest replicated checkpoint of this episode (``{"id", "step", "sandbox"}``) or None."""
        self.failovers: list[dict[str, Any]] = []
        """One record per node loss survived: lost node, boundary at loss, boundary resumed."""
        if spaces is None:
            self.start()
            spaces = self._get(self.actor.spaces.remote(), self.config.start_timeout_s, "start")
        self.observation_space, self.action_space = spaces

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.options = dict(options or {})
        self.step_count = 0
        for _ in range(self.config.max_failovers + 1):
            try:  # nothing is committed yet: a lost node means starting the reset again
                self._start()
                obs, info, self.resume_point = self._call("reset", seed, self.options,
                                                          timeout=self.config.start_timeout_s)
                return obs, info
            except _ActorLost as lost:
                self._forget(lost)
                self._drop_replicas()  # the previous episode's, left by the lost actor
                self.resume_point = None
        raise NodeLost(f"reset lost its node {self.config.max_failovers + 1} times in a row")

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.actor is None or self.options is None:
            raise UsageError("call reset() first")
        try:
            obs, reward, terminated, truncated, info, self.resume_point = self._call("step", action)
        except _ActorLost as lost:
            obs, info = self._failover(lost)
            return obs, 0.0, False, False, info
        self.step_count = int(info["belayer"]["step"])
        return obs, reward, terminated, truncated, info

    def trajectory(self) -> dict[str, Any]:
        """The env's trajectory record (committed steps and labelled infra events)."""
        return self._call("trajectory")

    def checkpoint_stats(self) -> list[dict[str, Any]]:
        """The current actor's replicated checkpoints (id, bytes, upload seconds)."""
        return self._call("checkpoint_stats")

    def close(self) -> None:
        """Close the env on its node (its sandbox and checkpoints go) and end the actor."""
        if self.actor is not None:
            try:
                self._call("close", timeout=120)
            except (_ActorLost, InfraError):
                self._drop_replicas()  # the actor went with its node: nobody else will
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)
        self.actor = None
        super().close()

    def _drop_replicas(self) -> None:
        if self.resume_point is None:
            return
        from belayer_env.store.replica import ReplicaLocation

        with contextlib.suppress(Exception):  # best effort: a later close or gc gets another chance
            ReplicaLocation(self.config.replica_url, key_file=self.config.replica_key_file,
                            **self.config.replica_options).remove_sandbox(
                self.resume_point["sandbox"])

    # ------------------------------------------------------------------ failover

    def start(self) -> None:
        """Have a live actor (placed by Ray on a node with a free sandbox slot)."""
        try:
            self._start()
        except _ActorLost as lost:
            raise NodeLost(f"an env actor could not start: {lost.cause}") from lost.cause

    def _start(self) -> None:
        if self.actor is None:
            self.actor = self._cls.remote(self.config)
            try:
                self.where = self._get(self.actor.where.remote(), self.config.start_timeout_s, "start")
            except _ActorLost as lost:
                with contextlib.suppress(Exception):  # e.g. still waiting for a slot: give it up
                    ray.kill(self.actor, no_restart=True)
                self.actor = None
                if isinstance(lost.cause, InfraError):  # no slot (or no answer) in time: not retried
                    raise NodeLost(f"an env actor could not start: {lost.cause}") from lost.cause
                raise  # e.g. placed on a node that died before Ray saw it dead: the next try is placed afresh

    def _failover(self, lost: _ActorLost) -> tuple[str, dict]:
        """Resume the episode on a new actor from the newest replicated checkpoint."""
        at_step = self.step_count
        for _ in range(self.config.max_failovers):
            lost_where = self._forget(lost)
            point = self.resume_point
            try:  # a replacement placed on a node that is dying too is one more loss
                self._start()
                obs, info, self.resume_point = self._call(
                    "resume", point["id"] if point else None, at_step, self.options, _short(lost.cause),
                    timeout=self.config.start_timeout_s + self.config.call_timeout_s)
            except _ActorLost as again:
                lost = again
                continue
            self.step_count = int(info["belayer"]["step"])
            self.failovers.append({"lost": lost_where, "node_dead": _node_dead(lost_where.get("node_id")),
                                   "at_step": at_step, "to_step": self.step_count, "now": dict(self.where)})
            return obs, info
        raise NodeLost(f"episode lost its node {self.config.max_failovers} times in a row: "
                       f"{lost.cause}") from lost.cause

    def _forget(self, lost: _ActorLost) -> dict[str, Any]:
        """Drop a lost actor (killed too, in case it only became unreachable)."""
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self.actor = None
        return dict(self.where)

    # ------------------------------------------------------------------ calls

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        ref = getattr(self.actor, method).remote(*args)
        return self._get(ref, timeout or self.config.call_timeout_s, method)

    def _get(self, ref: Any, timeout: float, what: str) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except RayActorError as e:
            raise _ActorLost(e) from e
        except GetTimeoutError as e:
            # a node that stopped answering is as good as lost: its sandbox is never used again
            raise _ActorLost(InfraError(f"env actor gave no answer to {what} within {timeout:g} s")) from e


class _ActorLost(NodeLost):
    """The actor (its process or its node) is gone; ``cause`` says how Ray saw it.

    Handled inside this module; one that escapes (e.g. from ``trajectory()``) is a ``NodeLost``."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def _node_dead(node_id: str | None) -> bool:
    if not node_id:
        return False
    try:
        return not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
    except Exception:  # noqa: BLE001 - the GCS itself is in trouble: say node lost
        return True


def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__
