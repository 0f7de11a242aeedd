"""``RayVectorEnv``: a ``gymnasium.vector.VectorEnv`` of sandboxes spread over a Ray cluster.

``num_envs`` ``RemoteSandboxEnv``s (one actor each, placed by Ray within each node's
sandbox limit), stepped in parallel. Observations are a tuple of strings (Gymnasium's
batch of a text space), rewards/terminations/truncations numpy arrays, infos merged the
Gymnasium way (``infos["belayer"]["rollback"]["to_step"][i]`` with the mask
``infos["belayer"]["_rollback"][i]``). A rollback, node loss included, is reported for
the sub-env it happened to and does not end its episode: the agent of that sub-env cuts
its context to ``to_step``.

Autoreset is Gymnasium's default, ``NEXT_STEP``: after sub-env i terminates or truncates,
the next ``step`` resets it (its action is ignored) and returns the reset observation,
reward 0 and ``terminated = truncated = False``. The reset options then come from
``autoreset_options(i)`` when given (e.g. the next task), else the sub-env's last ones.
``reset(options=...)`` takes one dict for every sub-env or a list of one dict per sub-env.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from belayer_core.errors import UsageError
from belayer_env.ray.config import RayEnvConfig
from belayer_env.ray.remote_env import RemoteSandboxEnv


class RayVectorEnv(VectorEnv):
    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": []}

    def __init__(self, num_envs: int, config: RayEnvConfig, *,
                 autoreset_options: Callable[[int], dict[str, Any]] | None = None):
        if num_envs < 1:
            raise UsageError(f"num_envs must be >= 1, got {num_envs}")
        self.num_envs = num_envs
        self.config = config
        self.autoreset_options = autoreset_options
        self._pool = ThreadPoolExecutor(num_envs, thread_name_prefix="belayer-vector")
        first = RemoteSandboxEnv(config)
        spaces = (first.observation_space, first.action_space)
        rest = list(self._pool.map(lambda _: RemoteSandboxEnv(config, spaces=spaces), range(num_envs - 1)))
        self.envs = [first, *rest]
        list(self._pool.map(lambda e: e.start(), rest))
        self.single_observation_space, self.single_action_space = spaces
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._autoreset = np.zeros(num_envs, dtype=np.bool_)
        self._options: list[dict[str, Any] | None] = [None] * num_envs
        self.closed = False

    def reset(self, *, seed: int | list[int] | None = None,
              options: dict[str, Any] | Sequence[dict[str, Any]] | None = None) -> tuple[tuple[str, ...], dict]:
        seeds = seed if isinstance(seed, list) else [None if seed is None else seed + i for i in range(self.num_envs)]
        per_env = list(options) if isinstance(options, Sequence) else [options] * self.num_envs
        if len(per_env) != self.num_envs or len(seeds) != self.num_envs:
            raise UsageError(f"reset needs {self.num_envs} option dicts/seeds, got {len(per_env)}/{len(seeds)}")
        self._options = per_env
        results = list(self._pool.map(lambda i: self.envs[i].reset(seed=seeds[i], options=per_env[i]),
                                      range(self.num_envs)))
        self._autoreset[:] = False
        infos: dict[str, Any] = {}
        for i, (_, info) in enumerate(results):
            infos = self._add_info(infos, info, i)
        return tuple(obs for obs, _ in results), infos

    def step(self, actions: Sequence[str]) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, dict]:
        if len(actions) != self.num_envs:
            raise UsageError(f"step needs {self.num_envs} actions, got {len(actions)}")
        results = list(self._pool.map(lambda i: self._step_one(i, actions[i]), range(self.num_envs)))
        obs = tuple(r[0] for r in results)
        rewards = np.array([r[1] for r in results], dtype=np.float64)
        terminations = np.array([r[2] for r in results], dtype=np.bool_)
        truncations = np.array([r[3] for r in results], dtype=np.bool_)
        infos: dict[str, Any] = {}
        for i, r in enumerate(results):
            infos = self._add_info(infos, r[4], i)
        self._autoreset = terminations | truncations
        return obs, rewards, terminations, truncations, infos

    def _step_one(self, i: int, action: str) -> tuple[str, float, bool, bool, dict]:
        env = self.envs[i]
        if self._autoreset[i]:
            options = self.autoreset_options(i) if self.autoreset_options else self._options[i]
            self._options[i] = options
            obs, info = env.reset(options=options)
            return obs, 0.0, False, False, info
        return env.step(action)

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call a method of every sub-env (e.g. ``"trajectory"``); Gymnasium's vector ``call``."""
        return tuple(self._pool.map(lambda e: getattr(e, name)(*args, **kwargs), self.envs))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        return tuple(getattr(e, name) for e in self.envs)

    def close_extras(self, **kwargs: Any) -> None:
        list(self._pool.map(lambda e: e.close(), self.envs))
        self._pool.shutdown(wait=True)
