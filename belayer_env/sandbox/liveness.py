"""Is a sandbox alive? The kernel's answer first, Docker's second, one exec when asked.

Docker updates a container's state a little after its init dies, so a command killed with
the container can end before Docker says so: the init's /proc entry is the ground truth
(``check_alive``). Docker also reports a container running until its init has finished
exiting, while an exec fails once it is exiting: ``confirm_alive`` adds one exec that forks
nothing. A sandbox whose own processes hold every slot of its pids limit, or whose probe is
killed at its memory limit, is alive: a command that hit a limit is the agent's outcome.
"""

from __future__ import annotations

import os
import time

import docker

from belayer_core.errors import SandboxLost
from belayer_core.procfs import read_stat
from belayer_env.sandbox import limits
from belayer_env.sandbox.docker_api import translate_errors

PROBE = ["bash", "-c", "exit 0"]  # a builtin: the probe forks nothing inside the sandbox
SETTLE_S = 2.0
"""How long an exec's exit code may lag the end of its stream."""


def check_alive(client: docker.DockerClient, container_id: str, what: str) -> None:
    """Raise ``SandboxLost`` unless the container and its init process are alive."""
    with translate_errors(what):
        state = client.api.inspect_container(container_id)["State"]
    if state.get("Running") and process_alive(state.get("Pid", 0)):
        return
    if state.get("OOMKilled"):
        reason = "was killed by the OOM killer"
    elif state.get("Running"):
        reason = "lost its init process"
    else:
        reason = f"exited ({state.get('Status')}, code {state.get('ExitCode')})"
    raise SandboxLost(f"{what}: container {container_id[:12]} {reason}")


def confirm_alive(client: docker.DockerClient, container_id: str, what: str) -> None:
    """``check_alive`` plus one exec (``PROBE``); an exec that cannot start at a limit of the
    sandbox's own (pids, memory) while the init lives is no evidence of death."""
    check_alive(client, container_id, what)
    before = limits.hits(container_id)
    api = client.api
    with translate_errors(what):
        exec_id = api.exec_create(container_id, PROBE, stdout=True, stderr=True)["Id"]
        api.exec_start(exec_id)
        settle = time.monotonic() + SETTLE_S
        while (info := api.exec_inspect(exec_id)).get("Running") and time.monotonic() < settle:
            time.sleep(0.02)
    code = None if info.get("Running") else info.get("ExitCode")
    if code == 0:
        return
    check_alive(client, container_id, what)
    after = limits.hits(container_id)
    if code is not None and (after.pids > before.pids or after.oom > before.oom):
        return  # it could not start, or was killed, at a limit of the sandbox's own
    raise SandboxLost(f"{what}: container {container_id[:12]} failed a liveness probe (exit {code})")


def process_alive(pid: int) -> bool:
    """True unless ``pid`` (a host pid) is gone, exiting or a zombie; unknowable (remote daemon) = True."""
    if not pid:
        return False
    if not os.path.isdir("/proc/1"):
        return True
    stat = read_stat(pid)
    return stat is not None and stat.running
