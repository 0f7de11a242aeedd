"""``DockerSandbox``: one real Docker container that runs one bash command per ``execute``.

Semantics follow mini-swe-agent's DockerEnvironment (``bash -lc``, stdout and stderr
merged, ``{"output", "returncode"}``), with three differences that matter for RL:
a command timeout kills the command (not the container) and is *returned* as an agent
outcome; output is capped with an explicit marker; and infrastructure failures (container
gone, daemon unreachable, exec transport broken) *raise* ``InfraError`` subclasses and are
never returned as output text.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from typing import Any

import docker
from docker.utils.socket import frames_iter
from pydantic import ValidationError

from belayer.errors import ConfigError, InvalidAction, SandboxLost, UsageError
from belayer.procfs import read_stat
from belayer_env.config import SandboxConfig
from belayer_env.docker_api import connect, translate_errors
from belayer_env.output import OutputCollector
from belayer_env.ownership import owner_labels

# PID 1 of every sandbox: a bash loop that reaps orphans (commands started in the background
# are reparented to it) and exits on SIGTERM. Small, so CRIU dumps it in milliseconds.
INIT_COMMAND = ["/bin/bash", "-c", "trap 'exit 0' TERM; while :; do sleep 86400 & wait $!; done"]
KILL_GRACE_S = 2  # SIGTERM, then SIGKILL this much later, for a timed-out command
OUTPUT_DIR = "/run/belayer"  # sandbox-private tmpfs: CRIU dumps and restores it with the container
OUTPUT_TMPFS = {OUTPUT_DIR: "size=64m,mode=0700"}

# Runs every command. Its output goes to a per-command file on the sandbox's private tmpfs,
# never to the exec pipe: a process the command leaves in the background (a server, say)
# then keeps a file, not a pipe to containerd-shim, so it neither holds the exec open nor
# dies of EPIPE once we stop reading, and CRIU can checkpoint and restore it. The wrapper
# then prints the capped output to the pipe and "belayer-meta RC SIZE" to stderr.
# Files still held by background processes are truncated (not removed) at the next command.
EXEC_WRAPPER = r"""
T=$1 MAX=$2 ID=$3 CMD=$4 K=$5
d=/run/belayer; [ -d "$d" ] && [ -w "$d" ] || { d=/tmp/.belayer; mkdir -p -m 700 "$d"; }
for o in "$d"/out.*; do
  [ -f "$o" ] || continue
  held=; for fd in /proc/[0-9]*/fd/[0-9]*; do [ "$fd" -ef "$o" ] 2>/dev/null && { held=1; break; }; done
  if [ -n "$held" ]; then : >"$o"; else rm -f "$o"; fi
done
f=$d/out.$ID; start=$SECONDS
timeout -k "$K" "$T" bash -lc "$CMD" >>"$f" 2>&1 </dev/null &
pid=$!; wait "$pid"; rc=$?
if { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && [ $((SECONDS - start)) -ge "${T%.*}" ]; then
  while kill -KILL -- "-$pid" 2>/dev/null; do :; done
fi
s=$(stat -c %s "$f" 2>/dev/null || echo 0)
echo "belayer-meta $rc $s" >&2
if [ "$s" -le "$MAX" ]; then head -c "$s" "$f"; else head -c $((MAX / 2)) "$f"; tail -c $((MAX - MAX / 2)) "$f"; fi
: >"$f"
exit "$rc"
"""
TRAILING_OUTPUT_S = 0.5  # after the command exits, wait this long for output still in flight
TRANSPORT_GRACE_S = 15.0  # past timeout + grace with no end of stream: the transport is broken
POLL_S = 0.2


def create_container(client: docker.DockerClient, config: SandboxConfig, name: str,
                     labels: dict[str, str] | None = None) -> Any:
    """Create (not start) a container for ``config``: the one recipe shared with restore."""
    all_labels = {**config.labels, **owner_labels(name), **(labels or {})}
    with translate_errors(f"create sandbox {name}"):
        try:
            client.images.get(config.image)
        except docker.errors.ImageNotFound as e:
            raise UsageError(
                f"image {config.image!r} not found; build the base image with `bash scripts/setup.sh`"
            ) from e
        return client.containers.create(
            config.image,
            command=INIT_COMMAND,
            name=name,
            working_dir=config.cwd if config.cwd != "/" else None,
            environment=config.env,
            labels=all_labels,
            network_mode=None if config.network else "none",
            mem_limit=config.memory,
            memswap_limit=config.memory,
            pids_limit=config.pids_limit,
            nano_cpus=int(config.cpus * 1e9),
            privileged=False,
            security_opt=["no-new-privileges"],
            tmpfs=OUTPUT_TMPFS,
            tty=False,
            stdin_open=False,
            detach=True,
        )


class DockerSandbox:
    """A running sandbox container. ``DockerSandbox()`` uses the base image built by set-up."""

    restored_from: str | None = None
    """Checkpoint id this container was restored from (set by ``full_restore``)."""
    degraded: bool = False
    """True only after an explicitly allowed file-system-only restore."""

    def __init__(self, config: SandboxConfig | None = None, *, name: str | None = None,
                 client: docker.DockerClient | None = None, **overrides: Any):
        try:
            if config is not None and overrides:
                config = SandboxConfig(**{**config.model_dump(), **overrides})
            self.config = config if config is not None else SandboxConfig(**overrides)
        except ValidationError as e:
            raise ConfigError(f"invalid sandbox config: {e}") from e
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
        result carries ``"timed_out": True``. Infra failures raise ``InfraError``.
        """
        if not isinstance(action, str):
            raise InvalidAction(f"action must be a str (one bash command), got {type(action).__name__}")
        if "\x00" in action:
            raise InvalidAction("action contains a NUL byte, which bash cannot receive")
        limit = self.config.timeout if timeout is None else float(timeout)
        if not limit > 0:
            raise InvalidAction(f"timeout must be > 0 seconds, got {timeout!r}")
        if cwd and not cwd.startswith("/"):
            raise InvalidAction(f"cwd must be an absolute path, got {cwd!r}")
        self._require_open()
        # coreutils' timeout owns the command's process group, so a timeout kills all of it
        argv = ["bash", "-c", EXEC_WRAPPER, "belayer-exec", f"{limit:g}",
                str(self.config.max_output_bytes), uuid.uuid4().hex[:16], action, str(KILL_GRACE_S)]
        what = f"exec in sandbox {self.name}"
        api = self.client.api
        collector = OutputCollector(self.config.max_output_bytes)
        hits_before = self._limit_hits()
        with translate_errors(what):
            exec_id = api.exec_create(self.container_id, argv, stdout=True, stderr=True, tty=False,
                                      workdir=cwd or self.config.cwd, environment=self.config.env)["Id"]
            start = time.monotonic()
            sock = api.exec_start(exec_id, socket=True)
            reader = _StreamReader(sock, collector)
            exit_code = self._wait(api, exec_id, reader, start + limit + KILL_GRACE_S + TRANSPORT_GRACE_S)
        elapsed = time.monotonic() - start
        timed_out = exit_code in (124, 137) and elapsed >= limit
        self.check_alive(what)
        if exit_code is None:
            raise SandboxLost(f"{what}: the exec transport broke (no exit code after {elapsed:.1f} s)")
        reader.apply_meta()
        output = collector.text()
        if timed_out:
            output += f"\n[belayer: command timed out after {limit:g} s and was killed]"
        oom_after, pids_after = self._limit_hits()
        if oom_after > hits_before[0]:
            output += f"\n[belayer: a process was killed for exceeding the memory limit ({self.config.memory})]"
        if pids_after > hits_before[1]:
            output += f"\n[belayer: process creation failed at the sandbox's limit of {self.config.pids_limit} processes]"
        result: dict[str, Any] = {"output": output, "returncode": exit_code}
        if timed_out:
            result["timed_out"] = True
        return result

    def _wait(self, api: Any, exec_id: str, reader: _StreamReader, deadline: float) -> int | None:
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

    def _cgroup_counter(self, controller: str, filename: str, key: str) -> int:
        """A counter from the container's cgroup (v1 or v2); 0 when unreadable."""
        cid = self.container_id
        for path in (f"/sys/fs/cgroup/{controller}/docker/{cid}/{filename}",
                     f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/{filename}",
                     f"/sys/fs/cgroup/docker/{cid}/{filename}"):
            try:
                with open(path) as f:
                    for line in f:
                        k, _, v = line.partition(" ")
                        if k == key:
                            return int(v)
            except (OSError, ValueError):
                continue
        return 0

    def _limit_hits(self) -> tuple[int, int]:
        """(OOM kills, fork refusals at the pids limit) so far, for reporting to the agent."""
        oom = self._cgroup_counter("memory", "memory.oom_control", "oom_kill") or \
            self._cgroup_counter("memory", "memory.events", "oom_kill")
        return oom, self._cgroup_counter("pids", "pids.events", "max")

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
        with contextlib.suppress(docker.errors.NotFound):
            try:
                self.client.api.remove_container(self.container_id, force=True, v=True)
            except docker.errors.APIError as e:
                if "removal of container" not in str(e) and "already in progress" not in str(e):
                    raise

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


class _StreamReader:
    """Reads a multiplexed exec stream on a thread into a bounded collector."""

    def __init__(self, sock: Any, collector: OutputCollector):
        self._sock = sock
        self.collector = collector
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._stderr = b""
        self._thread = threading.Thread(target=self._run, daemon=True, name="belayer-exec-reader")
        self._thread.start()

    def _run(self) -> None:
        try:
            for stream, data in frames_iter(self._sock, tty=False):
                if stream == 2:
                    self._stderr += data
                else:
                    self.collector.feed(data)
        except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
            self.error = e
        finally:
            self.done.set()

    def apply_meta(self) -> None:
        """Tell the collector the full output size the wrapper saw (it sends only head + tail)."""
        for line in self._stderr.decode("utf-8", "replace").splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "belayer-meta" and parts[2].isdigit():
                self.collector.total = max(self.collector.total, int(parts[2]))

    def close(self) -> None:
        raw = getattr(self._sock, "_sock", self._sock)
        with contextlib.suppress(OSError, AttributeError):
            raw.shutdown(2)
        with contextlib.suppress(OSError, AttributeError):
            self._sock.close()
        self._thread.join(timeout=2)
