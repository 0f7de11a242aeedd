"""The local dockerd's containerd: where it is, and ``ctr``, its own client.

Docker does not say which containerd it uses: ``locate`` reads it from the flags and
``daemon.json`` of the dockerd process serving the client's unix socket (its socket and
namespace, ``moby`` by default; ``BELAYER_CONTAINERD_ADDRESS`` and ``_NAMESPACE`` override).
``ctr`` comes with Debian's ``containerd`` package, which ``docker.io`` depends on
(``BELAYER_CTR`` names another); every call is bounded (``CTR_TIMEOUT_S``). Used to find and
remove what containerd keeps of sandbox containers Docker has forgotten (``ctrd_leftovers``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker

from belayer_core.procfs import processes, read_stat

CTR = os.environ.get("BELAYER_CTR", "ctr")
CTR_TIMEOUT_S = 30.0
"""Bound of every ``ctr`` call (a kill waits for the task's exit)."""
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


def ctr_path() -> str:
    found = shutil.which(CTR)
    if found is None:
        raise Unavailable(f"{CTR} not found (containerd's client: Debian's containerd package, which "
                          "docker.io installs; BELAYER_CTR names another)")
    return found


def ctr(daemon: Daemon, *args: str) -> str:
    """``ctr args...`` against ``daemon``'s containerd; its output, or ``CtrError`` with ctr's own error."""
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


def tasks(daemon: Daemon) -> dict[str, tuple[str, int | None]]:
    """containerd's tasks: id -> (status, pid)."""
    out: dict[str, tuple[str, int | None]] = {}
    for line in ctr(daemon, "tasks", "ls").splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3:
            out[parts[0]] = (parts[2], int(parts[1]) if parts[1].isdigit() else None)
    return out


def not_found(e: CtrError) -> bool:
    return "not found" in str(e)


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
