"""``DockerSandbox``: one real Docker container that runs one bash command per ``execute``.

Semantics follow mini-swe-agent's DockerEnvironment (``bash -lc``, stdout and stderr
merged, ``{"output", "returncode"}``), with three differences that matter for RL:
a command timeout kills the command (not the container) and is *returned* as an agent
outcome; output of any size is capped with an explicit marker without changing the
command's exit code; and infrastructure failures (container gone, daemon unreachable, exec
transport broken, runtime unable to run the command) *raise* ``InfraError`` subclasses and
are never returned as output text. The container itself is created with a disk cap and a
reduced capability set (``create_container``; docs/env.md, "Sandbox limits").
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from typing import Any

import docker

from belayer_core.errors import ConfigError, InvalidAction, SandboxLost, UsageError
from belayer_core.procfs import read_stat
from belayer_env.host import loopback
from belayer_env.sandbox import fence, limits
from belayer_env.sandbox.command import (
    CHUNK_BYTES,
    EXEC_WRAPPER,
    MAX_COMMAND_BYTES,
    RESERVED_PIDS,
    WRAPPER_PIDS,
    StreamReader,
)
from belayer_env.sandbox.config import INIT_COMMAND, OUTPUT_TMPFS, SandboxConfig
from belayer_env.sandbox.disk import limit_layer
from belayer_env.sandbox.docker_api import connect, translate_errors
from belayer_env.sandbox.output import OutputCollector
from belayer_env.sandbox.ownership import owner_labels

KILL_GRACE_S = 2  # SIGTERM, then SIGKILL this much later, for a timed-out command

TRAILING_OUTPUT_S = 0.5  # after the command exits, wait this long for output still in flight
TRANSPORT_GRACE_S = 15.0  # past timeout + grace with no end of stream: the transport is broken
POLL_S = 0.2
PROBE = ["bash", "-c", "exit 0"]  # a builtin: the probe forks nothing inside the sandbox


def create_container(client: docker.DockerClient, config: SandboxConfig, name: str,
                     labels: dict[str, str] | None = None, network_disabled: bool | None = None) -> Any:
    """Create (not start) a container for ``config``: the one recipe shared with restore.

    Capabilities are cut to ``config.capabilities`` and, with ``config.disk``, the writable
    layer is put on a file system of that size (``belayer_env.sandbox.disk``) before anything runs.
    ``network_disabled``: without Docker's network stack (``belayer_env.host.loopback``); None:
    whenever the sandbox has no network and this host has the loopback hook (a restore
    passes what its checkpoint's container had).
    """
    all_labels = {**config.labels, **owner_labels(name), **(labels or {})}
    if network_disabled is None:
        network_disabled = not config.network and loopback.installed()
    elif network_disabled and config.network:
        raise UsageError("a sandbox with network=True cannot be created with Docker's network stack disabled")
    elif network_disabled and not loopback.installed():
        raise UsageError(f"this container must be created without Docker's network stack, but the CRIU "
                         f"loopback hook is not installed here ({loopback.HOOK_PATH} listed in "
                         f"{loopback.RUNC_CRIU_CONF}): run `bash scripts/setup.sh`")
    with translate_errors(f"create sandbox {name}"):
        try:
            client.images.get(config.image)
        except docker.errors.ImageNotFound as e:
            raise UsageError(
                f"image {config.image!r} not found; build the base image with `bash scripts/setup.sh`"
            ) from e
        try:
            container = client.containers.create(
                config.image,
                command=INIT_COMMAND,
                name=name,
                working_dir=config.cwd if config.cwd != "/" else None,
                environment=config.env,
                labels=all_labels,
                network_mode=None if config.network else "none",
                network_disabled=network_disabled,
                mounts=[docker.types.Mount("/etc/hosts", str(loopback.HOSTS_PATH), type="bind",
                                           read_only=True)] if network_disabled else None,
                mem_limit=config.memory_bytes,  # bytes: docker-py parses no "t", "MiB" or "1.5g"
                memswap_limit=config.memory_bytes,
                pids_limit=config.pids_limit,
                nano_cpus=int(config.cpus * 1e9),
                privileged=False,
                security_opt=["no-new-privileges"],
                cap_drop=["ALL"],
                cap_add=list(config.capabilities),
                tmpfs=OUTPUT_TMPFS,
                tty=False,
                stdin_open=False,
                detach=True,
            )
        except docker.errors.APIError as e:
            if e.status_code == 400:  # the daemon refused a setting (e.g. more CPUs than the host has)
                raise ConfigError(f"Docker refused the sandbox config: {e.explanation or e}") from e
            raise
    if config.disk_bytes is not None:
        try:
            limit_layer(container.attrs, config.disk_bytes)  # docker-py inspected it after the create
        except BaseException:
            with contextlib.suppress(Exception):
                client.api.remove_container(container.id, force=True, v=True)
            raise
    return container


class DockerSandbox:
    """A running sandbox container. ``DockerSandbox()`` uses the base image built by set-up."""

    restored_from: str | None = None
    """Checkpoint id this container was restored from (set by ``full_restore``)."""
    degraded: bool = False
    """True only after an explicitly allowed file-system-only restore."""
    layer_installed_ns: int | None = None
    """Wall clock (ns) once ``full_restore`` had the whole layer in place and no process of
    the container had run yet: entries with an older ctime are still the checkpoint's (what
    an incremental capture of the restored sandbox skips)."""
    shared_lower: str | None = None
    """The shared read-only copy of its checkpoint's layer a fork runs on (``fork``;
    ``checkpoint.shared_layer``), None for a sandbox with a layer of its own."""

    def __init__(self, config: SandboxConfig | None = None, *, name: str | None = None,
                 client: docker.DockerClient | None = None, **overrides: Any):
        if config is not None and not isinstance(config, SandboxConfig):
            raise ConfigError(f"config must be a SandboxConfig, got {type(config).__name__}")
        self.config = SandboxConfig.merged(config, overrides)  # ConfigError naming each bad field
        self.client = client or connect(self.config.docker_host)
        self.name = name or f"{self.config.name_prefix}-{uuid.uuid4().hex[:12]}"
        container = create_container(self.client, self.config, self.name)
        self.container_id: str = container.id
        self._closed = False
        try:
            with translate_errors(f"start sandbox {self.name}"):
                container.start()
        except BaseException:
            self._remove_quietly()
            raise

    @classmethod
    def attach(cls, container_id: str, config: SandboxConfig, name: str,
               client: docker.DockerClient | None = None) -> DockerSandbox:
        """Wrap an already running container (e.g. one that ``full_restore`` started)."""
        self = cls.__new__(cls)
        self.config = config
        self.client = client or connect(config.docker_host)
        self.name = name
        self.container_id = container_id
        self._closed = False
        return self

    # ------------------------------------------------------------------ commands

    def execute(self, action: str, cwd: str = "", timeout: float | None = None) -> dict[str, Any]:
        """Run ``action`` with ``bash -lc``; return ``{"output", "returncode"}``.

        A timeout is an agent outcome: the command's process group is killed, the output
        ends with a marker, ``returncode`` is 124 (137 if it had to be SIGKILLed) and the
        result carries ``"timed_out": True``. Infra failures raise ``InfraError``; a command
        over ``MAX_COMMAND_BYTES`` (1 MiB) raises ``InvalidAction``.
        """
        if not isinstance(action, str):
            raise InvalidAction(f"action must be a str (one bash command), got {type(action).__name__}")
        if "\x00" in action:
            raise InvalidAction("action contains a NUL byte, which bash cannot receive")
        try:
            script = action.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidAction(f"action is not valid text ({e.reason} at index {e.start})") from e
        if len(script) > MAX_COMMAND_BYTES:
            raise InvalidAction(f"command is {len(script)} bytes; the limit is {MAX_COMMAND_BYTES} bytes (1 MiB): "
                                "write long content with several commands or copy it in as a file")
        limit = self.config.timeout if timeout is None else float(timeout)
        if not (limit > 0 and math.isfinite(limit)):
            raise InvalidAction(f"timeout must be > 0 seconds and finite, got {timeout!r}")
        if cwd and not cwd.startswith("/"):
            raise InvalidAction(f"cwd must be an absolute path, got {cwd!r}")
        self._require_open()
        max_out = self.config.max_output_bytes
        head, tail = max_out // 2, max_out - max_out // 2
        # coreutils' timeout owns the command's process group, so a timeout kills all of it
        argv = ["bash", "-c", EXEC_WRAPPER, "belayer-exec", f"{limit:g}", str(head), str(tail),
                uuid.uuid4().hex[:16], str(KILL_GRACE_S), str(max(tail, CHUNK_BYTES)), cwd or self.config.cwd,
                str(WRAPPER_PIDS), str(RESERVED_PIDS), *_pids_room(self.container_id)]
        what = f"exec in sandbox {self.name}"
        api = self.client.api
        collector = OutputCollector(max_out)
        hits_before = limits.hits(self.container_id)
        with translate_errors(what):
            # the wrapper starts in / and the command cds: a missing cwd is the command's failure
            # (bash's message, exit 1), never the runtime's text
            exec_id = api.exec_create(self.container_id, argv, stdout=True, stderr=True, stdin=True, tty=False,
                                      workdir="/", environment=self.config.env)["Id"]
            start = time.monotonic()
            sock = api.exec_start(exec_id, socket=True)
            reader = StreamReader(sock, collector)
            reader.send_and_close(script)
            exit_code = self._wait(api, exec_id, reader, start + limit + KILL_GRACE_S + TRANSPORT_GRACE_S)
        elapsed = time.monotonic() - start
        self.check_alive(what)
        if exit_code is None:
            raise SandboxLost(f"{what}: the exec transport broke (no exit code after {elapsed:.1f} s)")
        hits_after = limits.hits(self.container_id)
        meta, direct = reader.apply_meta(), reader.direct()
        output, note = collector.text(), limits.notes(hits_before, hits_after, self.config.memory, self.config.pids_limit)
        if direct is not None:
            # near the pids limit the exec became the command's ``timeout``: its exit code is the command's
            returncode = exit_code
            note = (f"\n[belayer: {direct[1]} of the sandbox's {direct[0]} processes (pids_limit) were in use: "
                    f"this command ran without its login profile]") + note
        elif meta is None:
            if exit_code == 126 and collector.total and hits_after.pids > hits_before.pids:
                # the runtime could not fork the exec into a sandbox whose own processes hold every
                # slot (the container lives: checked above; the runtime said why, where a stream cut
                # as the command starts says nothing): the agent's outcome, not the runtime's text
                returncode, output = 126, (f"[belayer: the command could not start: the sandbox's processes use all "
                                           f"{self.config.pids_limit} of its process slots (pids_limit)]")
                note = ""
            elif exit_code < 128:
                # the wrapper finished but its report was lost (the stream was cut), or it never
                # ran: what came back is a fragment or the runtime's text (e.g. "OCI runtime exec
                # failed"), not the command's output, and must not reach the agent
                raise SandboxLost(f"{what}: the command's report did not arrive (exec exit {exit_code}): "
                                  f"{_first_line(output)}")
            else:  # the wrapper was killed (the command ran `kill -9 -1`) or could not fork: its outcome
                returncode, output = exit_code, output + reader.wrapper_errors()
        else:
            returncode, sent = meta
            if reader.received < sent:
                raise SandboxLost(f"{what}: the exec stream was cut ({reader.received} of {sent} output "
                                  f"bytes arrived; the command exited {returncode})")
        timed_out = returncode in (124, 137) and elapsed >= limit
        if timed_out:
            output += f"\n[belayer: command timed out after {limit:g} s and was killed]"
        output += note
        result: dict[str, Any] = {"output": output, "returncode": returncode}
        if timed_out:
            result["timed_out"] = True
        return result

    def _wait(self, api: Any, exec_id: str, reader: StreamReader, deadline: float) -> int | None:
        """Wait for the stream to end or the command to exit; bounded by ``deadline``."""
        exited_at: float | None = None
        while True:
            if reader.done.wait(POLL_S):
                break
            now = time.monotonic()
            if now > deadline:
                break
            info = api.exec_inspect(exec_id)
            if not info.get("Running"):
                # safety net: the wrapper exited but something still holds the exec's pipe (the
                # wrapper keeps background jobs off it, so this needs a command that reopens it)
                exited_at = exited_at or now
                if now - exited_at >= TRAILING_OUTPUT_S:
                    break
        reader.close()
        if reader.error is not None and not reader.done.is_set():
            raise SandboxLost(f"exec stream failed: {reader.error}")
        settle = time.monotonic() + 2.0  # the exit code can lag the end of the stream a little
        while True:
            info = api.exec_inspect(exec_id)
            if not info.get("Running"):
                return info.get("ExitCode")
            if time.monotonic() > settle:
                return None
            time.sleep(0.02)

    # ------------------------------------------------------------------ health

    def check_alive(self, what: str) -> None:
        """Raise ``SandboxLost`` unless the container and its init process are alive.

        Docker updates a container's state a little after its init dies, so a command
        killed with the container can end first; the init's /proc entry is the ground truth.
        """
        with translate_errors(what):
            state = self.client.api.inspect_container(self.container_id)["State"]
        if state.get("Running") and _process_alive(state.get("Pid", 0)):
            return
        if state.get("OOMKilled"):
            reason = "was killed by the OOM killer"
        elif state.get("Running"):
            reason = "lost its init process"
        else:
            reason = f"exited ({state.get('Status')}, code {state.get('ExitCode')})"
        raise SandboxLost(f"{what}: container {self.container_id[:12]} {reason}")

    def is_alive(self) -> bool:
        try:
            self.check_alive("health check")
        except Exception:
            return False
        return True

    def confirm_alive(self, what: str) -> None:
        """``check_alive`` plus one exec: Docker reports a container running until its init has
        finished exiting, and an exec fails once it is exiting. The exec needs no fork (``bash
        -c 'exit 0'``), and one that cannot start because the sandbox's own processes hold every
        slot of its pids limit (or is killed at its memory limit) while the init lives is no
        evidence of death: a command that hit a limit is the agent's outcome."""
        self.check_alive(what)
        before = limits.hits(self.container_id)
        api = self.client.api
        with translate_errors(what):
            exec_id = api.exec_create(self.container_id, PROBE, stdout=True, stderr=True)["Id"]
            api.exec_start(exec_id)
            settle = time.monotonic() + 2.0  # the exit code can lag the end of the stream a little
            while (info := api.exec_inspect(exec_id)).get("Running") and time.monotonic() < settle:
                time.sleep(0.02)
        code = None if info.get("Running") else info.get("ExitCode")
        if code == 0:
            return
        self.check_alive(what)
        after = limits.hits(self.container_id)
        if code is not None and (after.pids > before.pids or after.oom > before.oom):
            return  # it could not start, or was killed, at a limit of the sandbox's own
        raise SandboxLost(f"{what}: container {self.container_id[:12]} failed a liveness probe (exit {code})")

    def _require_open(self) -> None:
        if self._closed:
            raise UsageError(f"sandbox {self.name} is closed")

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Remove the container (idempotent; a container already gone is fine)."""
        if self._closed:
            return
        self._closed = True
        self._remove_quietly()

    def _remove_quietly(self) -> None:
        fence.remove(self.client, self.container_id)  # and what containerd kept of it, if anything

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DockerSandbox(name={self.name!r}, container_id={self.container_id[:12]!r}, image={self.config.image!r})"

    # what mini-swe-agent-style code calls
    def get_template_vars(self) -> dict[str, Any]:
        return self.config.model_dump()


def _process_alive(pid: int) -> bool:
    """True unless ``pid`` (a host pid) is gone, exiting or a zombie; unknowable (remote daemon) = True."""
    if not pid:
        return False
    if not os.path.isdir("/proc/1"):
        return True
    stat = read_stat(pid)
    return stat is not None and stat.running


def _pids_room(container_id: str) -> tuple[str, str]:
    """(slots free beside the exec's own, the limit) for the wrapper; "-" when unknown here."""
    now = limits.pids(container_id)
    return ("-", "-") if now is None else (str(now[0] - now[1] - 1), str(now[0]))


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else "(no output)"
