"""containerd's leftovers of sandbox containers Docker has forgotten: found, and removed.

Why: Docker 20.10 (Debian's docker.io) handles a task-exit event of a container whose
containerd task is in fact still running (seen around CRIU restores) by marking the
container exited and deleting it from containerd, which refuses ("cannot delete running
task ...: failed precondition", dockerd's log). Docker then holds an exited container whose
processes still run, and its later removal never asks containerd again: containerd keeps
the container, its task (running, or STOPPED once something killed it) and the task's
``containerd-shim-runc-v2``, for good. Nothing but containerd knows of them.

Found in the containerd of the local dockerd (its socket and namespace, ``moby`` by default,
read from dockerd's flags and ``daemon.json``) with ``ctr``, containerd's own client (in
Debian's ``containerd`` package, which ``docker.io`` depends on; ``BELAYER_CTR`` names
another). A leftover is a containerd container that

- dockerd made (its ``com.docker/engine.bundle.path`` label),
- Docker does not know (not in its listing, made after containerd's, and its inspect answers
  NotFound): Docker registers a container before containerd ever sees it, so an id Docker
  does not know is one it is done with,
- and is a Belayer sandbox: its OCI spec runs the sandbox's own init
  (``config.INIT_COMMAND``) with the sandbox's private tmpfs at ``config.OUTPUT_DIR``.
  A container of anyone else is never touched.

``remove`` thaws its cgroup, kills and deletes the task (``ctr tasks delete --force``: kill,
wait for the exit, delete), deletes the container and Docker's bundle directory of it
(``<exec-root>/containerd/<id>``: its stdio FIFOs). ``belayer gc`` sweeps them all;
``after_removal`` checks one container Belayer has just removed through Docker
(``fence.remove``: a restore's failure, a fence; ``DockerSandbox.close``) in two ``stat`` calls and removes what
containerd still holds of it, so no removal of a sandbox leaves a shim behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests

from belayer_core.procfs import processes, read_stat
from belayer_env.sandbox import freezer
from belayer_env.sandbox.config import INIT_COMMAND, LEGACY_INIT_COMMANDS, OUTPUT_DIR

CTR = os.environ.get("BELAYER_CTR", "ctr")
CTR_TIMEOUT_S = 30.0
"""Bound of every ``ctr`` call (a kill waits for the task's exit)."""
BUNDLE_LABEL = "com.docker/engine.bundle.path"
DEFAULT_SOCKET = "/var/run/docker.sock"
DEFAULT_EXEC_ROOT = "/var/run/docker"
DEFAULT_NAMESPACE = "moby"
SYSTEM_CONTAINERD = "/run/containerd/containerd.sock"
DAEMON_JSON = "/etc/docker/daemon.json"


class Unavailable(Exception):
    """containerd cannot be looked at from here; the message says why."""


class CtrError(Exception):
    """A ``ctr`` call failed; the message is ctr's own error."""


@dataclass(frozen=True)
class Daemon:
    """Where the local dockerd's containerd is."""

    address: str
    namespace: str
    exec_root: str


@dataclass(frozen=True)
class Leftover:
    id: str
    task: str | None
    """containerd's status of its task (RUNNING, STOPPED, PAUSED, ...); None: it has none."""
    pid: int | None
    bundle: str
    """Docker's bundle directory of it (``BUNDLE_LABEL``)."""


@dataclass
class Sweep:
    found: list[Leftover] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """Id -> why it could not be removed."""
    unavailable: str | None = None
    """Why containerd could not be looked at (then nothing was found)."""


def ctr_path() -> str:
    found = shutil.which(CTR)
    if found is None:
        raise Unavailable(f"{CTR} not found (containerd's client: Debian's containerd package, which "
                          "docker.io installs; BELAYER_CTR names another)")
    return found


def sweep(client: docker.DockerClient, *, dry_run: bool = False, ids: list[str] | None = None) -> Sweep:
    """Find (``ids``: among these only) and, unless ``dry_run``, remove Belayer's leftovers in
    the containerd of ``client``'s dockerd. Never raises for containerd being out of reach:
    ``Sweep.unavailable`` says why it could not look."""
    out = Sweep()
    try:
        daemon = locate(client)
        out.found = find(client, daemon, ids=ids)
    except (Unavailable, CtrError) as e:
        out.unavailable = str(e)
        return out
    for lo in [] if dry_run else out.found:
        try:
            remove(daemon, lo)
        except CtrError as e:
            out.failed[lo.id] = str(e)
            continue
        out.removed.append(lo.id)
    return out


def after_removal(client: docker.DockerClient, container_id: str) -> list[str]:
    """Once Docker has removed ``container_id``: remove what containerd still holds of it (the
    ids removed). Two ``stat`` calls when nothing is left (runc's state of the task, Docker's
    bundle directory: both gone once Docker's own clean-up worked); never raises."""
    try:
        daemon = locate(client)
        runc_state = Path(daemon.exec_root) / "runtime-runc" / daemon.namespace / container_id
        bundle = Path(daemon.exec_root) / "containerd" / container_id
        if not runc_state.exists() and not bundle.exists():
            return []
        return sweep(client, ids=[container_id]).removed
    except Exception:  # noqa: BLE001 - a clean-up after a removal (Unavailable included): gc finds what it leaves
        return []


def find(client: docker.DockerClient, daemon: Daemon, *, ids: list[str] | None = None) -> list[Leftover]:
    """The leftovers (module docstring) in ``daemon``'s containerd."""
    try:
        listed = set(_ctr(daemon, "containers", "ls", "-q").split())
    except CtrError as e:
        raise Unavailable(f"cannot list containerd's containers at {daemon.address} "
                          f"(namespace {daemon.namespace}): {e}") from e
    if ids is not None:
        listed &= set(ids)
        if not listed:
            return []
    try:  # listed after containerd's: a container made meanwhile is known to Docker by now
        docker_side = client.api.containers(all=True)
    except (docker.errors.APIError, requests.exceptions.RequestException) as e:
        raise Unavailable(f"cannot list Docker's containers: {e}") from e
    known = {c["Id"] for c in docker_side}
    running = {c["Id"] for c in docker_side if c.get("State") == "running"}
    if ids is None and running and not running & listed:
        raise Unavailable(f"containerd at {daemon.address} (namespace {daemon.namespace}) holds none of "
                          "Docker's running containers: not this Docker's containerd")
    unknown = sorted(listed - known)
    if not unknown:
        return []
    tasks = _tasks(daemon)
    out = []
    for cid in unknown:
        try:
            info = json.loads(_ctr(daemon, "containers", "info", cid))
        except CtrError:
            continue  # gone meanwhile
        except ValueError:
            continue
        if not is_belayer_sandbox(info) or not _unknown_to_docker(client, cid):
            continue
        status, pid = tasks.get(cid, (None, None))
        out.append(Leftover(cid, status, pid, (info.get("Labels") or {}).get(BUNDLE_LABEL, "")))
    return out


def is_belayer_sandbox(info: dict[str, Any]) -> bool:
    """``ctr containers info``'s record of a container dockerd made for a Belayer sandbox:
    the sandbox's init as its process, the sandbox's private tmpfs mounted."""
    if BUNDLE_LABEL not in (info.get("Labels") or {}):
        return False
    spec = info.get("Spec") or {}
    if (spec.get("process") or {}).get("args") not in (INIT_COMMAND, *LEGACY_INIT_COMMANDS):
        return False
    return any(m.get("destination") == OUTPUT_DIR and m.get("type") == "tmpfs" for m in spec.get("mounts") or ())


def remove(daemon: Daemon, lo: Leftover) -> None:
    """Kill and delete its task, delete the container and Docker's bundle directory of it;
    what is gone already is fine. ``CtrError`` when containerd refuses."""
    freezer.thaw(lo.id)  # a frozen cgroup (a capture killed mid-pause) would hold the kill
    try:
        _ctr(daemon, "tasks", "delete", "--force", lo.id)  # kill, wait for the exit, delete
    except CtrError as e:
        if not _not_found(e):
            raise
    try:
        _ctr(daemon, "containers", "delete", lo.id)
    except CtrError as e:
        if not _not_found(e):
            raise
    bundle = Path(lo.bundle)
    if bundle.name == lo.id and os.path.realpath(bundle.parent) == os.path.realpath(Path(daemon.exec_root) / "containerd"):
        shutil.rmtree(bundle, ignore_errors=True)


def _unknown_to_docker(client: docker.DockerClient, cid: str) -> bool:
    try:
        client.api.inspect_container(cid)
    except docker.errors.NotFound:
        return True
    except (docker.errors.APIError, requests.exceptions.RequestException):
        return False
    return False


def _tasks(daemon: Daemon) -> dict[str, tuple[str, int | None]]:
    """containerd's tasks: id -> (status, pid)."""
    out: dict[str, tuple[str, int | None]] = {}
    for line in _ctr(daemon, "tasks", "ls").splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3:
            out[parts[0]] = (parts[2], int(parts[1]) if parts[1].isdigit() else None)
    return out


def _not_found(e: CtrError) -> bool:
    return "not found" in str(e)


def _ctr(daemon: Daemon, *args: str) -> str:
    argv = [ctr_path(), "--address", daemon.address, "--namespace", daemon.namespace, *args]
    what = f"ctr {' '.join(args[:2])}"
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CTR_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise CtrError(f"{what} did not answer within {CTR_TIMEOUT_S:g} s") from e
    except OSError as e:
        raise CtrError(f"{what}: {e}") from e
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines()
        raise CtrError(f"{what}: {lines[-1][-300:] if lines else f'exit {p.returncode}'}")
    return p.stdout


# ---------------------------------------------------------------- where dockerd's containerd is

_located: dict[str, tuple[tuple[int, int], Daemon]] = {}
_not_located: dict[str, tuple[float, str]] = {}
_located_lock = threading.Lock()
NOT_LOCATED_S = 60.0
"""How long "no such dockerd here" is believed before /proc is scanned again (``after_removal``
runs on every removal of a sandbox)."""


def locate(client: docker.DockerClient) -> Daemon:
    """The containerd of the dockerd behind ``client``'s unix socket, from that dockerd's
    flags and ``daemon.json`` (``BELAYER_CONTAINERD_ADDRESS`` and ``_NAMESPACE`` override);
    ``Unavailable`` when Docker is not local or no such dockerd is visible here."""
    socket = _socket_of(client)
    override = os.environ.get("BELAYER_CONTAINERD_ADDRESS")
    if override:
        return Daemon(override, os.environ.get("BELAYER_CONTAINERD_NAMESPACE", DEFAULT_NAMESPACE),
                      os.environ.get("BELAYER_DOCKER_EXEC_ROOT", DEFAULT_EXEC_ROOT))
    with _located_lock:
        cached = _located.get(socket)
        if cached is not None:
            (pid, start), daemon = cached
            stat = read_stat(pid)
            if stat is not None and stat.start_time == start and stat.comm == "dockerd":
                return daemon
        missed = _not_located.get(socket)
        if missed is not None and time.monotonic() - missed[0] < NOT_LOCATED_S:
            raise Unavailable(missed[1])
        try:
            pid, daemon = _dockerd_serving(socket)
        except Unavailable as e:
            _not_located[socket] = (time.monotonic(), str(e))
            raise
        _not_located.pop(socket, None)
        stat = read_stat(pid)
        if stat is not None:
            _located[socket] = ((pid, stat.start_time), daemon)
        return daemon


def _socket_of(client: docker.DockerClient) -> str:
    adapter = client.api.get_adapter(client.api.base_url)
    path = getattr(adapter, "socket_path", None)
    if not path:
        raise Unavailable(f"Docker is reached at {client.api.base_url}, not through a local unix socket: "
                          "its containerd is not this host's to look at")
    return os.path.realpath(path)


def _dockerd_serving(socket: str) -> tuple[int, Daemon]:
    procs = processes()
    managed = {p.ppid for p in procs if p.comm == "containerd"}  # a containerd dockerd started itself
    candidates = []
    for proc in procs:
        if proc.comm != "dockerd":
            continue
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        candidates.append((proc.pid, _settings(argv, managed=proc.pid in managed)))
    if not candidates:
        raise Unavailable("no dockerd process visible here (another pid namespace, or not root): "
                          "its containerd cannot be found")
    serving = [(pid, s) for pid, s in candidates if socket in s[0]]
    if not serving and len(candidates) == 1:
        serving = candidates  # the one dockerd here (e.g. -H fd://, a socket systemd made)
    if len(serving) != 1:
        raise Unavailable(f"{len(candidates)} dockerd processes here and {len(serving)} serve {socket}: "
                          "cannot tell whose containerd to look at (BELAYER_CONTAINERD_ADDRESS says)")
    pid, (_, daemon) = serving[0]
    return pid, daemon


def _settings(argv: list[str], *, managed: bool) -> tuple[set[str], Daemon]:
    """(the unix sockets it serves, where its containerd is) from dockerd's argv and config file.
    Without a containerd named there, dockerd uses the system's (``SYSTEM_CONTAINERD``) when
    that runs at its start, else starts its own (``managed``: a child of it) in its exec root."""
    flags: dict[str, list[str]] = {}
    names = {"-H": "host", "--host": "host", "--containerd": "containerd", "--exec-root": "exec-root",
             "--containerd-namespace": "containerd-namespace", "--config-file": "config-file"}
    i = 1
    while i < len(argv):
        arg, value = argv[i].partition("=")[::2]
        if arg in names:
            if not value and "=" not in argv[i] and i + 1 < len(argv):
                i += 1
                value = argv[i]
            flags.setdefault(names[arg], []).append(value)
        i += 1
    conf: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(Path((flags.get("config-file") or [DAEMON_JSON])[-1]).read_text() or "{}")
        conf = loaded if isinstance(loaded, dict) else {}

    def one(key: str, default: str) -> str:
        return (flags.get(key) or [conf.get(key) or default])[-1]

    hosts = flags.get("host") or conf.get("hosts") or [f"unix://{DEFAULT_SOCKET}"]
    sockets = {os.path.realpath(h.removeprefix("unix://")) for h in hosts if h.startswith("unix://")}
    exec_root = one("exec-root", DEFAULT_EXEC_ROOT)
    address = one("containerd", f"{exec_root}/containerd/containerd.sock" if managed else SYSTEM_CONTAINERD)
    return sockets, Daemon(address, one("containerd-namespace", DEFAULT_NAMESPACE), exec_root)
