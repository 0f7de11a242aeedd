"""``DockerSandbox``: one real Docker container that runs one bash command per ``execute``.

Semantics follow mini-swe-agent's DockerEnvironment (``bash -lc``, stdout and stderr
merged, ``{"output", "returncode"}``), with three differences that matter for RL:
a command timeout kills the command (not the container) and is *returned* as an agent
outcome; output of any size is capped with an explicit marker without changing the
command's exit code; and infrastructure failures (container gone, daemon unreachable, exec
transport broken, runtime unable to run the command) *raise* ``InfraError`` subclasses and
are never returned as output text. The container itself is created by ``create.py`` (a disk
cap, a reduced capability set: docs/env.md, "Sandbox limits"); whether it is alive is
``liveness.py``'s answer.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import docker

from belayer_core.errors import ConfigError, InvalidAction, SandboxLost, UsageError
from belayer_env.sandbox import limits, liveness, removal
from belayer_env.sandbox.command import (
    CHUNK_BYTES,
    EXEC_WRAPPER,
    MAX_COMMAND_BYTES,
    RESERVED_PIDS,
    WRAPPER_PIDS,
    StreamReader,
)
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.create import create_container
from belayer_env.sandbox.docker_api import connect, translate_errors
from belayer_env.sandbox.output import OutputCollector

KILL_GRACE_S = 2  # SIGTERM, then SIGKILL this much later, for a timed-out command

TRAILING_OUTPUT_S = 0.5  # after the command exits, wait this long for output still in flight
TRANSPORT_GRACE_S = 15.0  # past timeout + grace with no end of stream: the transport is broken
POLL_S = 0.2


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
        settle = time.monotonic() + liveness.SETTLE_S  # the exit code can lag the end of the stream
        while True:
            info = api.exec_inspect(exec_id)
            if not info.get("Running"):
                return info.get("ExitCode")
            if time.monotonic() > settle:
                return None
            time.sleep(0.02)

    # ------------------------------------------------------------------ health

    def check_alive(self, what: str) -> None:
        """Raise ``SandboxLost`` unless the container and its init process are alive
        (``liveness.check_alive``: the init's /proc entry is the ground truth)."""
        liveness.check_alive(self.client, self.container_id, what)

    def is_alive(self) -> bool:
        try:
            self.check_alive("health check")
        except Exception:
            return False
        return True

    def confirm_alive(self, what: str) -> None:
        """``check_alive`` plus one exec that forks nothing (``liveness.confirm_alive``): one that
        cannot start at a limit of the sandbox's own is the agent's outcome, not a death."""
        liveness.confirm_alive(self.client, self.container_id, what)

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
        removal.remove(self.client, self.container_id)  # and what containerd kept of it, if anything

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DockerSandbox(name={self.name!r}, container_id={self.container_id[:12]!r}, image={self.config.image!r})"

    # what mini-swe-agent-style code calls
    def get_template_vars(self) -> dict[str, Any]:
        return self.config.model_dump()


def _pids_room(container_id: str) -> tuple[str, str]:
    """(slots free beside the exec's own, the limit) for the wrapper; "-" when unknown here."""
    now = limits.pids(container_id)
    return ("-", "-") if now is None else (str(now[0] - now[1] - 1), str(now[0]))


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else "(no output)"
