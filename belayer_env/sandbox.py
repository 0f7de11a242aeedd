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
import socket
import threading
import time
import uuid
from typing import Any

import docker
from docker.utils.socket import frames_iter

from belayer.errors import ConfigError, InvalidAction, SandboxLost, UsageError
from belayer.procfs import read_stat
from belayer_env import loopback
from belayer_env.config import SandboxConfig
from belayer_env.disk import limit_layer
from belayer_env.docker_api import connect, translate_errors
from belayer_env.output import OutputCollector
from belayer_env.ownership import owner_labels

# PID 1 of every sandbox: a bash loop that reaps orphans (commands started in the background
# are reparented to it) and exits on SIGTERM. Small, so CRIU dumps it in milliseconds.
INIT_COMMAND = ["/bin/bash", "-c", "trap 'exit 0' TERM; while :; do sleep 86400 & wait $!; done"]
KILL_GRACE_S = 2  # SIGTERM, then SIGKILL this much later, for a timed-out command
OUTPUT_DIR = "/run/belayer"  # sandbox-private tmpfs: CRIU dumps and restores it with the container
OUTPUT_TMPFS = {OUTPUT_DIR: "size=64m,mode=0700"}

MAX_COMMAND_BYTES = 2**20
"""Longest command ``execute`` takes (UTF-8 bytes). It travels on the exec's stdin, not in its
argv, so the kernel's 128 KiB per-argument limit and containerd's message limit never apply."""
CHUNK_BYTES = 2**20  # the in-sandbox keeper rotates chunk files of this size for the tail

# Runs every command. The command arrives on stdin and is saved to a file; it runs with its
# output (stdout and stderr merged) on a FIFO, never on the exec pipe. A keeper (``drain``)
# reads the FIFO and keeps only the head (H bytes) and the last two chunks (C >= T bytes
# each) on the sandbox's private tmpfs, counting the rest: output of any size can neither
# fill the tmpfs nor change the command's exit code (a full FIFO blocks the writer; it never
# fails it). A background job the command leaves behind keeps the FIFO, not a pipe to
# containerd-shim, so it neither holds the exec open nor dies of EPIPE, and CRIU can
# checkpoint it and its keeper; once its command has been collected, the keeper goes on
# draining into one chunk file. When the command exits, the wrapper waits for the keeper's
# end of stream (or, while background jobs still hold the FIFO, until the keeper has read
# everything: the FIFO is empty and its ``head`` is blocked reading it; bounded), prints
# the head and the tail to the exec pipe and "belayer-meta RC TOTAL SENT" to stderr, and exits 0.
# So the host knows a complete result (exit 0, a report, SENT bytes received) from one the
# transport cut (SandboxLost) and from a wrapper the command killed (its signal exit code).
EXEC_WRAPPER = r"""
T=$1 H=$2 TL=$3 ID=$4 K=$5 C=$6 CWD=$7
d=/run/belayer; [ -d "$d" ] && [ -w "$d" ] || { d=/tmp/.belayer; mkdir -p -m 700 "$d"; }
for o in "$d"/c.*; do
  [ -d "$o" ] || continue
  p=; q=; read -r q <"$o/wpid" 2>/dev/null; read -r p <"$o/pid" 2>/dev/null
  [ -n "$q" ] && kill -0 "$q" 2>/dev/null && continue  # its command is still running or being collected
  if [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then : >"$o/x"; else rm -rf "$o"; fi
done
w=$d/c.$ID; mkdir -m 700 "$w" || exit 125
echo $$ >"$w/wpid"
cat >"$w/cmd"; printf '%s' "$CWD" >"$w/cwd"
mkfifo -m 600 "$w/p" "$w/q" || exit 125
echo 0 >"$w/n"; : >"$w/h"; : >"$w/c.0"; : >"$w/c.1"
exec 5<>"$w/p" 6<>"$w/q" 8<"$w/p"
u=; command -v stdbuf >/dev/null && u="stdbuf -o0"  # head's stdio would hold bytes back
drain() {
  echo "$BASHPID" >"$w/pid"
  $u head -c "$H" >"$w/h"
  n=0
  while :; do
    echo "$n" >"$w/n"
    f=$w/c.$((n % 2)); [ -e "$w/x" ] && f=$w/c.d
    exec 3>"$f"; $u head -c "$C" >&3
    pos=; { read -r _ pos <"/proc/$BASHPID/fdinfo/3"; } 2>/dev/null  # our offset: a truncation can't move it
    exec 3>&-
    [ "${pos:-$(stat -c %s "$f")}" = "$C" ] || break
    n=$((n + 1))
  done
  echo >&6
}
drain <"$w/p" >/dev/null 2>&1 5>&- 8>&- &
dp=$!
start=$SECONDS
timeout -k "$K" "$T" bash -lc "cd -- \"\$(< $w/cwd)\" && eval \"\$(< $w/cmd)\"" >"$w/p" 2>&1 </dev/null 5>&- 6>&- 8>&- &
pid=$!; wait "$pid"; rc=$?
if { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && [ $((SECONDS - start)) -ge "${T%.*}" ]; then
  while kill -KILL -- "-$pid" 2>/dev/null; do :; done
fi
drained() {
  read -t 0 -u 8 && return 1
  local kids=() k wc
  read -r -a kids <"/proc/$dp/task/$dp/children" 2>/dev/null
  [ "${#kids[@]}" -gt 0 ] || return 1
  for k in "${kids[@]}"; do
    wc=; read -r wc <"/proc/$k/wchan" 2>/dev/null
    case "$wc" in *pipe_read*) ;; *) return 1 ;; esac
  done
}
kill -0 -- "-$pid" 2>/dev/null || exec 5>&-
i=0 eof=
until read -t 0.02 -u 6 _ && eof=1; do
  drained && break
  i=$((i + 1)); [ "$i" -ge 150 ] && break
done
[ -n "$eof" ] && wait "$dp"  # it has signalled its end: let it exit, so its staging goes now
exec 5>&- 8>&-
sz() { stat -c %s "$1" 2>/dev/null || echo 0; }  # 0 when the command removed our files
for _ in 1 2 3; do
  n=0; read -r n <"$w/n"
  set -- $(stat -c %s "$w/h" "$w/c.0" "$w/c.1" 2>/dev/null)
  if [ "$#" = 3 ]; then hs=$1 s0=$2 s1=$3; else hs=$(sz "$w/h") s0=$(sz "$w/c.0") s1=$(sz "$w/c.1"); fi
  n2=; read -r n2 <"$w/n"; [ "$n" = "$n2" ] && break
done
if [ $((n % 2)) = 0 ]; then cur=$w/c.0 cs=$s0 prev=$w/c.1; else cur=$w/c.1 cs=$s1 prev=$w/c.0; fi
total=$((hs + n * C + cs)); rest=$((total - hs)); keep=$rest; [ "$keep" -gt "$TL" ] && keep=$TL
if [ "$n" -gt 0 ]; then have=$(($(sz "$prev") + cs)); else have=$cs; fi
[ "$keep" -gt "$have" ] && keep=$have
# RC, bytes the command wrote, bytes sent below: fewer received means the transport was cut
echo "belayer-meta $rc $total $((hs + keep))" >&2
head -c "$hs" "$w/h" 2>/dev/null
if [ "$keep" -gt 0 ]; then
  if [ "$n" -gt 0 ]; then cat "$prev" "$cur"; else cat "$cur"; fi 2>/dev/null | tail -c "$keep"
fi
# a keeper still draining a background job: its files are truncated, never removed (its head
# goes on writing at its offset into a hole; it tells a full chunk by its own file offset, never
# by the file's size, which this truncation can zero between its head's exit and its check)
if kill -0 "$dp" 2>/dev/null; then : >"$w/x"; : >"$w/h"; : >"$w/c.0"; : >"$w/c.1"; rm -f "$w/cmd"; else rm -rf "$w"; fi
exit 0  # the command's code is in the report: a nonzero exec exit means the wrapper itself died
"""
TRAILING_OUTPUT_S = 0.5  # after the command exits, wait this long for output still in flight
TRANSPORT_GRACE_S = 15.0  # past timeout + grace with no end of stream: the transport is broken
POLL_S = 0.2


def create_container(client: docker.DockerClient, config: SandboxConfig, name: str,
                     labels: dict[str, str] | None = None, network_disabled: bool | None = None) -> Any:
    """Create (not start) a container for ``config``: the one recipe shared with restore.

    Capabilities are cut to ``config.capabilities`` and, with ``config.disk``, the writable
    layer is put on a file system of that size (``belayer_env.disk``) before anything runs.
    ``network_disabled``: without Docker's network stack (``belayer_env.loopback``); None:
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
                mem_limit=config.memory,
                memswap_limit=config.memory,
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
                uuid.uuid4().hex[:16], str(KILL_GRACE_S), str(max(tail, CHUNK_BYTES)), cwd or self.config.cwd]
        what = f"exec in sandbox {self.name}"
        api = self.client.api
        collector = OutputCollector(max_out)
        hits_before = self._limit_hits()
        with translate_errors(what):
            # the wrapper starts in / and the command cds: a missing cwd is the command's failure
            # (bash's message, exit 1), never the runtime's text
            exec_id = api.exec_create(self.container_id, argv, stdout=True, stderr=True, stdin=True, tty=False,
                                      workdir="/", environment=self.config.env)["Id"]
            start = time.monotonic()
            sock = api.exec_start(exec_id, socket=True)
            reader = _StreamReader(sock, collector)
            reader.send_and_close(script)
            exit_code = self._wait(api, exec_id, reader, start + limit + KILL_GRACE_S + TRANSPORT_GRACE_S)
        elapsed = time.monotonic() - start
        self.check_alive(what)
        if exit_code is None:
            raise SandboxLost(f"{what}: the exec transport broke (no exit code after {elapsed:.1f} s)")
        meta = reader.apply_meta()
        if meta is None:
            if exit_code < 128:
                # the wrapper finished but its report was lost (the stream was cut), or it never
                # ran: what came back is a fragment or the runtime's text (e.g. "OCI runtime exec
                # failed"), not the command's output, and must not reach the agent
                raise SandboxLost(f"{what}: the command's report did not arrive (exec exit {exit_code}): "
                                  f"{_first_line(collector.text())}")
            returncode = exit_code  # the wrapper was killed (the command ran `kill -9 -1`): its outcome
        else:
            returncode, sent = meta
            if reader.received < sent:
                raise SandboxLost(f"{what}: the exec stream was cut ({reader.received} of {sent} output "
                                  f"bytes arrived; the command exited {returncode})")
        timed_out = returncode in (124, 137) and elapsed >= limit
        output = collector.text()
        if timed_out:
            output += f"\n[belayer: command timed out after {limit:g} s and was killed]"
        oom_after, pids_after = self._limit_hits()
        if oom_after > hits_before[0]:
            output += f"\n[belayer: a process was killed for exceeding the memory limit ({self.config.memory})]"
        if pids_after > hits_before[1]:
            output += f"\n[belayer: process creation failed at the sandbox's limit of {self.config.pids_limit} processes]"
        result: dict[str, Any] = {"output": output, "returncode": returncode}
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


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else "(no output)"


class _StreamReader:
    """Reads a multiplexed exec stream on a thread into a bounded collector."""

    def __init__(self, sock: Any, collector: OutputCollector):
        self._sock = sock
        self.collector = collector
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._stderr = b""
        self.received = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="belayer-exec-reader")
        self._thread.start()

    def _run(self) -> None:
        try:
            for stream, data in frames_iter(self._sock, tty=False):
                if stream == 2:
                    self._stderr += data
                else:
                    self.received += len(data)
                    self.collector.feed(data)
        except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
            self.error = e
        finally:
            self.done.set()

    def send_and_close(self, data: bytes) -> None:
        """Write the command to the exec's stdin and half-close it (the wrapper reads to EOF)."""
        raw = getattr(self._sock, "_sock", self._sock)
        try:
            raw.sendall(data)
            raw.shutdown(socket.SHUT_WR)
        except OSError as e:
            raise SandboxLost(f"the exec stream broke while the command was sent ({e})") from e

    def apply_meta(self) -> tuple[int, int] | None:
        """Tell the collector the full output size the wrapper saw (it sends only head + tail);
        return (the command's exit code, the bytes the wrapper sent), or None when the report
        did not arrive (the wrapper did not run, was killed, or the stream was cut)."""
        for line in self._stderr.decode("utf-8", "replace").splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "belayer-meta" and all(p.isdigit() for p in parts[1:]):
                self.collector.total = max(self.collector.total, int(parts[2]))
                return int(parts[1]), int(parts[3])
        return None

    def close(self) -> None:
        raw = getattr(self._sock, "_sock", self._sock)
        with contextlib.suppress(OSError, AttributeError):
            raw.shutdown(2)
        with contextlib.suppress(OSError, AttributeError):
            self._sock.close()
        self._thread.join(timeout=2)
