"""``EpisodeSandbox``: the episode's sandbox under its name, which the env and its ``Recovery``
share: boundary 0 (a fresh container plus the task's setup), the fence of every container of
that name, and whether the container ended by itself. Whoever replaces the sandbox (a reset,
a rollback, a fork, a resume) sets ``sandbox`` and ``name`` here; nothing else holds them."""

from __future__ import annotations

import contextlib
import time
import uuid

import docker

from belayer_core.errors import UsageError
from belayer_core.procfs import read_stat
from belayer_env.common.phases import Phase, PhaseHooks
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.fence import fence, sandbox_containers
from belayer_env.sandbox.fence import kill as fence_kill

OWN_EXIT_WAIT_S = 5.0


class EpisodeSandbox:
    """The sandbox of one episode: its container, name, settings and setup commands."""

    def __init__(self, client: docker.DockerClient, config: SandboxConfig, hooks: PhaseHooks):
        self.client = client
        self.config = config
        """The episode's settings (the env's, with the image ``reset`` was given)."""
        self.hooks = hooks
        self.setup: list[str] = []
        """The task's setup commands, run on every boundary 0."""
        self.name = ""
        self.sandbox: DockerSandbox | None = None

    def new_name(self) -> str:
        return f"{self.config.name_prefix}-env-{uuid.uuid4().hex[:12]}"

    def initial_state(self) -> DockerSandbox:
        """Boundary 0: a fresh container from the episode's image plus the task's setup."""
        sandbox = DockerSandbox(self.config, name=self.name, client=self.client)
        try:
            self.hooks(Phase.CREATED)
            for command in self.setup:
                result = sandbox.execute(command)
                if result["returncode"] != 0:
                    raise UsageError(f"task setup failed (exit {result['returncode']}): {command!r}\n{result['output'][-2000:]}")
            self.hooks(Phase.VERIFIED)
        except BaseException:
            with contextlib.suppress(Exception):
                sandbox.close()
            raise
        return sandbox

    def fence(self, *, wait_removed: bool = True) -> None:
        """Kill and remove every container of this episode's sandbox name (the dead one too).

        ``wait_removed=False`` (recovery, reset): return once they are dead and the name is
        free, their removal left to a thread (a big writable layer takes a second or more to
        delete, on the rollback's critical path before; ``belayer gc`` reaps what a dying
        process leaves). Not ``sandbox.close()`` first: on a wedged container that blocks in
        Docker; the fence thaws it before it asks Docker for anything about it."""
        if self.name:
            with contextlib.suppress(Exception):
                fence(self.client, self.name, background=not wait_removed)
        elif self.sandbox is not None:
            with contextlib.suppress(Exception):
                self.sandbox.close()

    def kill(self) -> list[str]:
        """``fence`` without the removal: kill and rename aside (the name is free); returns
        what is left to ``remove_in_background``. Dead in the kernel's view is enough: Docker's
        state says so 50-150 ms later, a wait the rollback need not make."""
        if not self.name:
            return []
        try:
            return fence_kill(self.client, self.name, docker_view=False)
        except Exception:  # noqa: BLE001 - as fence: the restore's own fence tries again
            return []

    def name_blocked(self, fenced: set[str]) -> bool:
        """A container of this sandbox still runs or holds its name after the fence (``fenced``
        ones are dead and renamed aside, whatever Docker's state says yet; their removal maybe
        still under way)."""
        try:
            return any(c.get("State") not in ("exited", "dead", "created", "removing")
                       or f"/{self.name}" in (c.get("Names") or ())
                       for c in sandbox_containers(self.client, self.name, by_name=True) if c["Id"] not in fenced)
        except Exception:  # noqa: BLE001 - daemon trouble: the restore attempts will report it
            return False

    def own_exit(self) -> int | None:
        """The container's exit code when its init exited by itself (e.g. the action ran
        ``kill -TERM 1``): not killed by a signal (>= 128), not OOM-killed. None otherwise,
        including a container still running (a broken transport, say)."""
        if self.sandbox is None:
            return None
        deadline = time.monotonic() + OWN_EXIT_WAIT_S
        try:
            while True:
                state = self.client.api.inspect_container(self.sandbox.container_id)["State"]
                if not state.get("Running"):
                    break
                init = read_stat(state.get("Pid") or 0)
                if (init is not None and init.running) or time.monotonic() > deadline:
                    return None
                time.sleep(0.02)  # the init is exiting: Docker records the exit a moment later
        except Exception:  # noqa: BLE001 - gone or unreadable: no evidence, treat as infra
            return None
        code = state.get("ExitCode")
        if state.get("OOMKilled") or not isinstance(code, int) or not 0 <= code < 128:
            return None
        return code
