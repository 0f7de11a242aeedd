"""``Sandbox``: what the checkpoint mechanism and the probes need of a sandbox.

``DockerSandbox`` is the one implementation; the checkpoint code takes this protocol so it
says what it relies on: a Docker container (id + client), its creation config (to
recreate it on restore) and a way to run a command in it.
"""

from __future__ import annotations

from typing import Any, Protocol

import docker

from belayer_env.sandbox.config import SandboxConfig


class Sandbox(Protocol):
    @property
    def name(self) -> str:
        """Sandbox name (checkpoints are filed under it; a restore reuses it)."""
        ...

    @property
    def container_id(self) -> str: ...

    @property
    def client(self) -> docker.DockerClient: ...

    @property
    def config(self) -> SandboxConfig: ...

    def execute(self, action: str, cwd: str = "", timeout: float | None = None) -> dict[str, Any]:
        """Run one bash command; ``{"output", "returncode"}``; infra failures raise."""
        ...
