"""Containers created ahead (``ContainerPool``): Docker's create off a restore's or a fork's
critical path. ``RestoreSpare``: the same for the sandbox's own next restore (``EnvConfig(restore_spare=
True)``, ``full_restore(spare=)``): one container created ahead, without a disk cap (the
restore mounts its pre-staged layer file system there, or caps it then), named and
labelled ``<sandbox>-spare-<id>`` (so fencing the sandbox does not touch it) until the
restore renames it to the sandbox's name once the sandbox's containers are fenced.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import docker

from belayer_core.errors import BelayerError, UsageError
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.create import create_container
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.ownership import SANDBOX_NAME
from belayer_env.sandbox.removal import remove_quietly

MAX_POOL = 64


@dataclass(frozen=True)
class Slot:
    """One created (not started) container waiting for a fork."""

    container_id: str
    inspect: dict[str, Any]
    target: str
    """The fork's sandbox name (its label since creation; the container takes it at start)."""
    alias: str
    """Its shared-lower label: the alias made for it when a fork takes it ("" for a
    ``RestoreSpare``'s container, which serves an unshared restore)."""


class ContainerPool:
    """Up to ``size`` containers created ahead, made like ``sandbox``'s; subclasses say how
    one is created (``_create``)."""

    def __init__(self, sandbox: DockerSandbox, size: int, *, new_name: Callable[[], str] | None = None):
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_POOL:
            raise UsageError(f"a fork pool's size must be an int in 1..{MAX_POOL}, got {size!r}")
        self.client: docker.DockerClient = sandbox.client
        self.size = size
        self._new_name = new_name or (lambda: f"{sandbox.name}-fork-{uuid.uuid4().hex[:8]}")
        self.config, self.network_disabled = _made_as(sandbox)
        self._slots: list[Slot] = []
        self._lock = threading.Lock()
        self._filler: threading.Thread | None = None
        self._closed = False
        self.error: BaseException | None = None
        """Why the last fill stopped early (None: it did not)."""

    def new_name(self) -> str:
        """A fresh fork name, as this pool names its containers' sandboxes."""
        return self._new_name()

    def serves(self, sandbox: DockerSandbox) -> bool:
        """Whether checkpoints of ``sandbox`` fork into this pool's containers."""
        return _made_as(sandbox) == (self.config, self.network_disabled)

    def matches(self, checkpoint_config: SandboxConfig, image_id: str | None, network_disabled: bool) -> bool:
        """Whether a checkpoint with these settings restores into this pool's containers."""
        return (image_id == self.config.image and network_disabled == self.network_disabled
                and checkpoint_config.model_copy(update={"image": image_id}) == self.config)

    def take_for(self, checkpoint_config: SandboxConfig, manifest: dict[str, Any], n: int) -> list[Slot]:
        """Up to ``n`` containers if a checkpoint with this config and manifest restores into
        them (``matches``), else none."""
        if not self.matches(checkpoint_config, manifest.get("image_id"), bool(manifest.get("network_disabled"))):
            return []
        return self.take(n)

    def fill(self) -> None:
        """Top the pool up to ``size`` on a background thread (no-op while one runs)."""
        with self._lock:
            if self._closed or (self._filler is not None and self._filler.is_alive()):
                return
            self.error = None
            self._filler = threading.Thread(target=self._fill, daemon=True, name="belayer-fork-pool")
            self._filler.start()

    def wait_filled(self, timeout: float = 120.0) -> bool:
        """Wait (bounded) for the running fill; True when the pool holds ``size`` containers."""
        filler = self._filler
        if filler is not None:
            filler.join(timeout)
        return len(self) == self.size

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def container_ids(self) -> list[str]:
        with self._lock:
            return [s.container_id for s in self._slots]

    def take(self, n: int) -> list[Slot]:
        """Up to ``n`` containers, now the caller's (a fork starts or removes each)."""
        with self._lock:
            taken, self._slots = self._slots[:n], self._slots[n:]
        return taken

    def close(self) -> None:
        """Stop filling and remove every container still waiting."""
        with self._lock:
            self._closed = True
            filler = self._filler
        if filler is not None:
            filler.join()
        for slot in self.take(MAX_POOL):
            remove_quietly(self.client, slot.container_id)

    def _fill(self) -> None:
        while True:
            with self._lock:
                if self._closed or len(self._slots) >= self.size:
                    return
            try:
                slot = self._create()
            except (BelayerError, docker.errors.DockerException, OSError) as e:
                self.error = e
                return
            with self._lock:
                if not self._closed:
                    self._slots.append(slot)
                    continue
            remove_quietly(self.client, slot.container_id)
            return

    def _create(self) -> Slot:
        raise NotImplementedError


Pool = TypeVar("Pool", bound="ContainerPool")


def kept_filled(pool: Pool | None, wanted: bool, sandbox: DockerSandbox | None,
                make: Callable[[DockerSandbox], Pool]) -> Pool | None:
    """``pool`` topped up in the background for ``sandbox``: made (``make``) where there is
    none, replaced where it was made for another image or settings; left as it is when not
    ``wanted`` or no sandbox runs. What an env keeps filled: its fork pool, its restore spare."""
    if not wanted or sandbox is None:
        return pool
    if pool is not None and not pool.serves(sandbox):
        pool.close()
        pool = None
    if pool is None:  # not ``pool or``: an empty pool is falsy (``len``)
        pool = make(sandbox)
    pool.fill()
    return pool


def _made_as(sandbox: DockerSandbox) -> tuple[SandboxConfig, bool]:
    """How ``sandbox``'s container was made: its settings with the image's id, and whether
    without Docker's network stack (what a checkpoint of it records, and a fork needs)."""
    with translate_errors(f"inspect sandbox {sandbox.name}"):
        info = sandbox.client.api.inspect_container(sandbox.container_id)
    return sandbox.config.model_copy(update={"image": info["Image"]}), bool(info["Config"].get("NetworkDisabled"))


class RestoreSpare(ContainerPool):
    """One container created ahead for the next restore of ``sandbox`` (under its name).

    Why: Docker's create is 50-100 ms of a restore's ~300 (more under load); created
    ahead, on a thread, it costs no memory (no process runs) and only a created
    container's metadata on disk. ``full_restore(ck, spare=s)`` takes it when ``ck`` was
    taken of a container made like it (module docstring), else creates as before.
    """

    def __init__(self, sandbox: DockerSandbox, *, new_name: Callable[[], str] | None = None):
        super().__init__(sandbox, 1, new_name=new_name or (lambda: f"{sandbox.name}-spare-{uuid.uuid4().hex[:8]}"))

    def _create(self) -> Slot:
        name = self.new_name()  # its own sandbox name until the restore renames it: not fenced with the sandbox
        container = create_container(self.client, self.config.model_copy(update={"disk": None}), name,
                                     labels={SANDBOX_NAME: name}, network_disabled=self.network_disabled)
        return Slot(container.id, container.attrs, name, alias="")
