"""``fork``: N independent sandboxes from one checkpoint, all at its boundary.

For GRPO groups that share a prefix and for tree search: every fork is a restore of the
same checkpoint (its file-system layer and every process, CRIU) under a sandbox name of
its own, so each one is prefix-consistent with the checkpoint and fenced, labelled and
reaped (``belayer gc``) like any other sandbox. Forks run their restores side by side.

Sharing (``share=True``, the default): the checkpoint's layer is unpacked and verified
once, then shared read-only by every fork as its top overlay lower layer, each fork
writing copy-on-write into an empty upperdir of its own (``store/shared_layer.py``:
how, what differs, lifetime). Not shared, each fork unpacking its own copy as a plain
restore does: ``share=False``, or a layer with hardlinked files. The CRIU images are
verified once (hardlinked from the store onto Docker's disk and hashed, beside the layer's
unpack) and hardlinked from there into every fork (read only).

Order (docs/fork.md: where the time goes): the layer's unpack + verify and
the images' verify start on threads, and the forks' containers (with their disk caps)
are created meanwhile, side by side; each fork waits for both to be verified before it
takes its name and starts. A fork's name is new (generated, or ``fresh_names``), so
nothing is fenced before; a failure anywhere fences every fork made (all or none).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import uuid
from collections.abc import Callable
from pathlib import Path

import docker

from belayer_core.errors import RestoreFailed, UsageError
from belayer_env.criu import runtime
from belayer_env.forks.ahead import discard_images, verified_images
from belayer_env.forks.pool import ForkPool
from belayer_env.forks.warm import WarmForks
from belayer_env.restore import prestaging
from belayer_env.restore.cleanup import clean_later, cleanup_deferred
from belayer_env.restore.restore import full_restore
from belayer_env.restore.spare import RestoreSpare, Slot
from belayer_env.restore.trust import check_bounded
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.docker_api import connect
from belayer_env.sandbox.fence import fence
from belayer_env.store import layer, shared_layer, shared_lease, shared_sweep
from belayer_env.store.manifest import Checkpoint, read_manifest_digest

MAX_FORKS = 64
Restore = Callable[..., DockerSandbox]
"""``full_restore`` with the restoring side's config bound."""
SETTLE_S = 60.0


def fork_name(checkpoint: Checkpoint, index: int) -> str:
    return f"{checkpoint.sandbox}-fork{index}-{uuid.uuid4().hex[:8]}"


def fork(checkpoint: Checkpoint, n: int, *, client: docker.DockerClient | None = None,
         names: list[str] | None = None, parallel: int = 8, share: bool = True,
         fresh_names: bool = False, pool: ForkPool | None = None,
         config: SandboxConfig | None = None, warm: WarmForks | None = None) -> list[DockerSandbox]:
    """Restore ``checkpoint`` ``n`` times into new sandboxes; all or none.

    ``warm``: forks of this checkpoint restored ahead and frozen (``warm_forks``): where it
    holds ``n`` of them (made for the same ``config``), they are thawed and returned, with
    no restore on the call (a preparation still running is waited for); otherwise the
    forks are restored as below.

    ``share``: the forks share the checkpoint's layer copy-on-write (module docstring);
    each fork's ``.shared_lower`` names the shared copy (None: a copy of its own).
    ``names``: the forks' sandbox names (default: generated, a random suffix each); every
    container already holding one is fenced first, unless ``fresh_names`` says none can
    (random names, as generated ones are: a restore that finds one taken fails instead).
    ``pool``: forks start in its containers where it has them and the checkpoint was taken
    of a container made like them (``fork_pool``; not with ``names``, nor unshared), named
    as the pool named them; the rest are created here, named by the pool too.
    ``config``: the restoring side's settings (``full_restore(config=)``; default: the
    secure defaults): what the forks may ask for at most, checked before anything is made.
    Raises ``RestoreFailed`` (the first failure) after fencing every fork already made; the
    sandbox the checkpoint was taken from is never touched.
    """
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_FORKS:
        raise UsageError(f"n must be an int in 1..{MAX_FORKS}, got {n!r}")
    if names is not None and (len(names) != n or len(set(names)) != n or checkpoint.sandbox in names):
        raise UsageError("names must be n distinct sandbox names, none the checkpoint's own")
    if isinstance(pool, RestoreSpare):
        raise UsageError("a restore spare serves its sandbox's own restore (full_restore(spare=)), not forks")
    if pool is not None and (names is not None or not share):
        raise UsageError("a fork pool names its forks and serves shared forks: no names=, no share=False")
    if (warm is not None and names is None and share and warm.config == config
            and (ready := warm.take(checkpoint, n, wait_s=SETTLE_S)) is not None):
        return ready
    client = client or connect((config or SandboxConfig()).docker_host)  # never the manifest's daemon
    try:
        data = read_manifest_digest(Path(checkpoint.path))[0]
    except ValueError as e:
        raise RestoreFailed(f"checkpoint {checkpoint.id} is incomplete: {e}", checkpoint=checkpoint.id) from e
    check_bounded(client, checkpoint, data, config)  # once for all forks, before any is made
    restore = functools.partial(full_restore, config=config)
    generated = names is None or fresh_names  # no container holds them: nothing to fence first
    if pool is not None:
        names = [pool.new_name() for _ in range(n)]
    names = names or [fork_name(checkpoint, i) for i in range(n)]
    if not share:
        return _restore_all(restore, checkpoint, client, names, parallel, None, fence_first=not generated)
    root = prestaging.docker_root(client)
    with cleanup_deferred():
        # copies no container uses any more (best effort): removed once the forks started,
        # not before (an API call per copy and alias: tens of ms of a fork's CPU)
        clean_later(shared_sweep.sweep, client, root)
        shared_sweep.sweep_at_exit(client, root)  # and the copies this process's forks leave
        return _fork_shared(restore, checkpoint, client, names, n, parallel, generated, pool, root)


def warm_forks(checkpoint: Checkpoint, n: int, *, client: docker.DockerClient | None = None,
               pool: ForkPool | None = None, config: SandboxConfig | None = None) -> WarmForks:
    """``n`` forks of ``checkpoint`` restored now on a thread (``fork``, into ``pool`` where
    given) and frozen, for a later ``fork(checkpoint, k, warm=...)`` (k <= n) to thaw
    (``forks/warm.py``). Close it to fence the ones not taken."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_FORKS:
        raise UsageError(f"n must be an int in 1..{MAX_FORKS}, got {n!r}")
    client = client or connect((config or SandboxConfig()).docker_host)
    return WarmForks(checkpoint, n, client, lambda k: fork(checkpoint, k, client=client, pool=pool, config=config),
                     config=config)


def _fork_shared(restore: Restore, checkpoint: Checkpoint, client: docker.DockerClient, names: list[str], n: int, parallel: int,
                 generated: bool, pool: ForkPool | None, root: str) -> list[DockerSandbox]:
    try:
        data, digest = read_manifest_digest(Path(checkpoint.path))
    except ValueError as e:
        raise RestoreFailed(f"checkpoint {checkpoint.id} is incomplete: {e}", checkpoint=checkpoint.id) from e
    images_job = None
    ahead = pool.ahead if pool is not None else None
    borrowed = ahead.borrow(checkpoint, digest) if ahead is not None else None  # verified ahead (``fork_ahead``)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="belayer-fork-images") as one:
            # the CRIU images verified once for all forks, and the layer unpacked once, both
            # while the forks' containers are created; each fork starts once both are verified
            if borrowed is not None:
                images_job = concurrent.futures.Future()
                images_job.set_result(borrowed)
            elif checkpoint.has_runtime:
                images_job = one.submit(verified_images, checkpoint, client, data)
            with shared_lease.lease(client, checkpoint, root, data, digest) as shared:
                slots = pool.take_for(checkpoint.config, data, n) if pool is not None and shared is not None else []
                if slots:  # the pool's containers, then new ones for the rest
                    names = [s.target for s in slots] + names[len(slots):]
                try:
                    return _restore_all(restore, checkpoint, client, names, parallel, shared, images_job, not generated,
                                        slots)
                except RestoreFailed as e:
                    if not isinstance(e.__cause__, shared_lease.Unshareable):
                        raise
            # hardlinked files (learnt while unpacking): every fork was fenced; a copy each
            return _restore_all(restore, checkpoint, client, names, parallel, None, images_job, not generated)
    except layer.LayerError as e:
        raise RestoreFailed(f"checkpoint {checkpoint.id}: file-system layer unusable: {e}",
                            checkpoint=checkpoint.id) from e
    except (runtime.CriuError, OSError) as e:
        raise RestoreFailed(f"checkpoint {checkpoint.id}: runtime images unusable: {e}",
                            checkpoint=checkpoint.id) from e
    finally:  # every fork has linked its own (or failed): the shared verified copy goes
        if borrowed is not None:
            ahead.give_back()  # the pool's: kept for the next fork of this checkpoint
        elif images_job is not None and images_job.done() and images_job.exception() is None:
            discard_images(images_job.result())


def _restore_all(restore: Restore, checkpoint: Checkpoint, client: docker.DockerClient, names: list[str], parallel: int,
                 shared: shared_layer.SharedLower | None,
                 images: concurrent.futures.Future[Path] | None = None,
                 fence_first: bool = True, slots: list[Slot] | None = None) -> list[DockerSandbox]:
    slots = slots or []
    with cleanup_deferred(), concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(parallel, len(names))),
                                               thread_name_prefix="belayer-fork") as pool:
        futures = [pool.submit(restore, checkpoint, client=client, name=name, use_staged=False, shared=shared,
                               verified_images=images, fence_first=fence_first,
                               precreated=slots[i] if i < len(slots) else None)
                   for i, name in enumerate(names)]
        concurrent.futures.wait(futures)
    forks = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for name in names:  # all or none: a partial group is not a group
            with contextlib.suppress(Exception):
                fence(client, name, background=False)
        raise failed[0]
    for f in forks:
        f.shared_lower = shared.name if shared is not None else None
    return forks
