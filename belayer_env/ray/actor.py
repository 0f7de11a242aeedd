"""``SandboxEnvActor``: one ``ResumableSandboxEnv`` on one Ray node (the node's Docker engine).

A plain class made remote by ``actor_class()``: each replies with the env's ordinary
values plus the *resume point* (the newest checkpoint already replicated off the node),
which the driver keeps so that, if this node dies, another actor can ``resume`` there.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from belayer_core.errors import NodeLost
from belayer_env.env.resumable import ResumableSandboxEnv
from belayer_env.ray.config import RayEnvConfig


class SandboxEnvActor:
    def __init__(self, config: RayEnvConfig):
        self.env = ResumableSandboxEnv(config.env, replica_url=config.replica_url,
                                       replica_options=config.replica_options,
                                       replica_key_file=config.replica_key_file,
                                       checkpoint_policy=config.checkpoint_policy)

    def where(self) -> dict[str, Any]:
        """This actor's node and process (a lost node's containers carry this pid as owner)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "host": socket.gethostname()}

    def spaces(self) -> tuple[Any, Any]:
        return self.env.observation_space, self.env.action_space

    def reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict, dict | None]:
        obs, info = self.env.reset(seed=seed, options=options)
        return obs, info, self._point()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict, dict | None]:
        return (*self.env.step(action), self._point())

    def resume(self, checkpoint_id: str | None, at_step: int, options: dict[str, Any] | None,
               lost: str) -> tuple[str, dict, dict | None]:
        """Continue a lost episode here; ``lost`` says how the driver saw the old actor go."""
        error = NodeLost(f"env actor lost at boundary {at_step} ({lost}); the episode continues on "
                         f"{socket.gethostname()} from {checkpoint_id or 'boundary 0'}")
        obs, info = self.env.resume(checkpoint_id, at_step=at_step, options=options, error=error)
        return obs, info, self._point()

    def trajectory(self) -> dict[str, Any]:
        return self.env.trajectory.model_dump(mode="json")

    def checkpoint_stats(self) -> list[dict[str, Any]]:
        """Every replicated checkpoint of this actor: id, bytes, upload seconds (measurements)."""
        return [{"id": i, "bytes": b, "upload_s": t} for i, b, t in self.env.checkpointer.store.uploads]

    def close(self) -> None:
        self.env.close()

    def _point(self) -> dict | None:
        point = self.env.resume_point()
        return None if point is None else {**point, "sandbox": self.env.name}


def actor_class(config: RayEnvConfig) -> Any:
    """The remote class with the config's placement: one ``config.resource`` unit, no CPU
    reserved (the sandbox's CPU is capped by Docker), never restarted by Ray (a restarted
    actor would start a fresh sandbox; the driver resumes the episode instead)."""
    import ray

    options = {"num_cpus": 0, "resources": {config.resource: 1}, "max_restarts": 0,
               "max_task_retries": 0, **config.actor_options}
    return ray.remote(SandboxEnvActor).options(**options)
