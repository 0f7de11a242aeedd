"""``RecoverableSandboxEnv.fork(n)``: n envs at an env's current boundary, each over a sandbox
forked (``belayer_env.forks.fork``) from that boundary's checkpoint."""

from __future__ import annotations

import copy
import time
from typing import Any, TypeVar

from belayer_core.errors import UsageError
from belayer_env.forks.fork import SETTLE_S, fork
from belayer_env.store.manifest import Checkpoint

Env = TypeVar("Env", bound=Any)
"""A ``RecoverableSandboxEnv`` (not imported: it imports this module)."""


def fork_env(env: Env, n: int, make: type[Env]) -> list[Env]:
    """``n`` envs at ``env``'s current boundary k, each with a sandbox forked from k.

    Boundary k's checkpoint is the newest ready one if it is k's, else one taken now (and
    kept by ``env``, which may restore it too). Each fork copies the trajectory, task,
    setup and policy state; it starts with no checkpoints of its own (a failure before
    its first one rolls it back to boundary 0, still prefix-consistent) and is closed by
    its caller like any env.
    """
    if env.sandbox is None or env._done:
        raise UsageError("fork() needs a running episode: call reset() first")
    k = len(env.trajectory.steps)
    ck = boundary_checkpoint(env, k)
    if env.fork_pool is not None:  # its containers first; it names every fork as the env does
        try:
            sandboxes = fork(ck, n, client=env.client, pool=env.fork_pool, config=env.sandbox.config)
        finally:
            env.refill_fork_pool()
    else:
        names = [env.episode.new_name() for _ in range(n)]
        sandboxes = fork(ck, n, client=env.client, names=names, fresh_names=True, config=env.sandbox.config)
    children = []
    for sandbox in sandboxes:
        child = make(env.config, checkpoint_policy=copy.deepcopy(env.policy),
                     reward=env.reward_fn, client=env.client)
        child.episode.sandbox, child.episode.name = sandbox, sandbox.name
        child.episode.config, child.episode.setup = env.episode.config, list(env.episode.setup)
        child.trajectory = env.trajectory.model_copy(deep=True)
        child.last_result = dict(env.last_result)
        child._done, child._last_return = False, time.monotonic()
        children.append(child)
    return children


def boundary_checkpoint(env: Env, k: int) -> Checkpoint:
    """A ready checkpoint of ``env``'s boundary ``k`` (its sandbox's current one): the newest
    ready one if it is k's, else one taken now and kept as ready (``env`` may restore it too)."""
    checkpointer = env.checkpointer
    checkpointer.settle(k, SETTLE_S)
    if checkpointer.ready and checkpointer.ready[-1].step == k:
        return checkpointer.ready[-1]
    return checkpointer.capture_now(env.sandbox, k)
