"""Creation settings of a sandbox container (one pydantic config for the Docker backend).

The same config recreates an equivalent container on restore, so everything that shapes
the container (image, limits, tty, env, working dir) lives here and nowhere else.

Every way of configuring a sandbox (``DockerSandbox(...)``, ``EnvConfig``, ``gym.make``
keyword arguments, reset options) ends in a constructor of a ``StrictModel``, which turns
pydantic's ``ValidationError`` into one ``ConfigError`` (a ``UsageError``) naming each
bad field. ``model_copy(update=...)`` skips validation: use ``SandboxConfig.merged``.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from belayer_core.errors import ConfigError

DEFAULT_IMAGE = os.environ.get("BELAYER_BASE_IMAGE", "belayer-base:latest")
OUTPUT_DIR = "/run/belayer"  # sandbox-private tmpfs: CRIU dumps and restores it with the container
# PID 1 of every sandbox: bash, which reaps orphans (commands started in the background are
# reparented to it) and exits on SIGTERM. One process: it blocks in a read of a FIFO of its
# own that nobody writes (CRIU dumps each process inside the freeze, ~1.5-2 ms apiece here),
# a byte at a time (a sandbox process that writes an endless line into it grows nothing);
# where it cannot make that FIFO (a user that cannot write OUTPUT_DIR, no mkfifo) it loops
# on a sleep child, as every sandbox did before.
INIT_COMMAND = ["/bin/bash", "-c", f"trap 'exit 0' TERM; f={OUTPUT_DIR}/.init; "
                "if mkfifo -m 600 $f 2>/dev/null && { exec 3<>$f; } 2>/dev/null; then "
                "while :; do read -r -n 1 -u 3 _; done; fi; while :; do sleep 86400 & wait $!; done"]
LEGACY_INIT_COMMANDS = (["/bin/bash", "-c", "trap 'exit 0' TERM; while :; do sleep 86400 & wait $!; done"],)
"""The init of sandboxes made by earlier versions (``belayer gc`` still recognises them)."""
OUTPUT_TMPFS = {OUTPUT_DIR: "size=64m,mode=0700"}
MANAGED_LABEL = "belayer.managed"

DOCKER_DEFAULT_CAPABILITIES = (
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "NET_RAW", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
)
"""What Docker grants a container by default: ``capabilities=DOCKER_DEFAULT_CAPABILITIES`` restores it."""
DEFAULT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "NET_BIND_SERVICE", "SETGID", "SETUID")
"""What a software-engineering task needs: root that owns and edits files (chown, chmod, writes to
files of other users), ``su``/``setpriv``-style user switching, signals to its own processes, and
binding a low port on loopback. Dropped from Docker's set: NET_RAW (raw and packet sockets),
MKNOD (device nodes), SETFCAP/SETPCAP (file and bounding-set capabilities), SYS_CHROOT, AUDIT_WRITE."""
_KNOWN_CAPABILITIES = frozenset({
    "AUDIT_CONTROL", "AUDIT_READ", "AUDIT_WRITE", "BLOCK_SUSPEND", "BPF", "CHECKPOINT_RESTORE", "CHOWN",
    "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "IPC_LOCK", "IPC_OWNER", "KILL", "LEASE",
    "LINUX_IMMUTABLE", "MAC_ADMIN", "MAC_OVERRIDE", "MKNOD", "NET_ADMIN", "NET_BIND_SERVICE",
    "NET_BROADCAST", "NET_RAW", "PERFMON", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYSLOG",
    "SYS_ADMIN", "SYS_BOOT", "SYS_CHROOT", "SYS_MODULE", "SYS_NICE", "SYS_PACCT", "SYS_PTRACE",
    "SYS_RAWIO", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "WAKE_ALARM",
})

MAX_OUTPUT_BYTES_LIMIT = 16 * 2**20
"""Upper bound of ``max_output_bytes``: the kept head and tail are staged on the sandbox's tmpfs."""
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([bkmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a Docker-style size (``512m``, ``1g``, ``1.5GiB``); ``ValueError`` otherwise."""
    m = _SIZE.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"expected a size such as 512m or 2g, got {text!r}")
    return int(float(m.group(1)) * _UNIT[m.group(2).lower()])


def host_ram() -> int | None:
    """Bytes of RAM of this machine; None when unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return None


def _local_daemon(docker_host: str | None) -> bool:
    """The daemon runs on this machine (a unix socket): its host's limits are this one's."""
    return (docker_host or os.environ.get("DOCKER_HOST") or "unix://").startswith("unix://")


def describe(error: ValidationError) -> str:
    """One line naming every bad field: ``cpus: must be > 0, got 0; foo: unknown option``."""
    parts = []
    for e in error.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        msg = "unknown option" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


class StrictModel(BaseModel):
    """A config whose construction raises ``ConfigError`` (a ``UsageError``) naming the bad fields."""

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(f"invalid {type(self).__name__}: {describe(e)}") from e

    @classmethod
    def merged(cls, base: Self | None, overrides: dict[str, Any]) -> Self:
        """``base`` with ``overrides`` applied, validated like a fresh config (``ConfigError``)."""
        if base is None:
            return cls(**overrides)
        if not overrides:
            return base
        return cls(**{**base.model_dump(), **overrides})


class SandboxConfig(StrictModel):
    """How to create a sandbox. Secure by default: no network, bounded memory/pids/CPU/disk,
    capabilities cut to what an SWE task needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = DEFAULT_IMAGE
    docker_host: str | None = None
    """Docker daemon URL (e.g. unix:///var/run/docker.sock); None = the environment's. Before the
    limits: a daemon on this machine bounds ``memory`` by this machine's RAM."""
    cwd: str = "/"
    """Working directory for commands when ``execute`` gets no ``cwd``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set in the container and for every command."""
    timeout: float = 30.0
    """Default command timeout in seconds (an agent outcome, not an error)."""
    network: StrictBool = False
    """Attach a network. Off by default: sandboxes must not reach the outside."""
    memory: str = "1g"
    """Memory limit (docker syntax: 512m, 2g, 1.5GiB). Swap is not allowed on top of it. With a
    daemon on this machine, at most its RAM: a limit it cannot honour is refused here."""
    pids_limit: int = 512
    cpus: float = 1.0
    disk: str | None = "5g"
    """Size of the container's writable layer (docker syntax). A write beyond it fails inside the
    sandbox with ENOSPC. The layer is an ext4 file system in a sparse file of this size, so the
    host spends only what is written. None: no limit (the host's disk is the limit)."""
    capabilities: tuple[str, ...] = DEFAULT_CAPABILITIES
    """Linux capabilities of the sandbox's root (every other one is dropped);
    ``DOCKER_DEFAULT_CAPABILITIES`` gives Docker's default set back."""
    max_output_bytes: int = 100_000
    """Output beyond this is cut in the middle with a truncation marker."""
    labels: dict[str, str] = Field(default_factory=dict)
    name_prefix: str = "belayer"

    @field_validator("cwd")
    @classmethod
    def _absolute_cwd(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"cwd must be an absolute path inside the container, got {v!r}")
        return v

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, v: float) -> float:
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"must be > 0 seconds and finite, got {v}")
        return v

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: float) -> float:
        if not (v >= 0.01 and math.isfinite(v)):
            raise ValueError(f"must be >= 0.01 (a CPU share), got {v}")
        return v

    @field_validator("pids_limit")
    @classmethod
    def _pids(cls, v: int) -> int:
        if v < 16:
            raise ValueError(f"must be >= 16 (a shell and its command need a few), got {v}")
        return v

    @field_validator("max_output_bytes")
    @classmethod
    def _output(cls, v: int) -> int:
        if not 16 <= v <= MAX_OUTPUT_BYTES_LIMIT:
            raise ValueError(f"must be between 16 and {MAX_OUTPUT_BYTES_LIMIT} bytes, got {v}")
        return v

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str, info: ValidationInfo) -> str:
        size = parse_size(v)
        if size < 6 * 2**20:
            raise ValueError(f"must be at least 6m (Docker's minimum), got {v!r}")
        ram = host_ram() if _local_daemon(info.data.get("docker_host")) else None
        if ram is not None and size > ram:
            raise ValueError(f"must be at most this host's RAM ({ram / 2**30:.1f} GiB), got {v!r}")
        return v

    @field_validator("disk")
    @classmethod
    def _disk(cls, v: str | None) -> str | None:
        if v is not None and parse_size(v) < 64 * 2**20:
            raise ValueError(f"must be at least 64m (or None for no limit), got {v!r}")
        return v

    @field_validator("capabilities", mode="before")
    @classmethod
    def _capabilities(cls, v: Any) -> Any:
        if isinstance(v, str):
            raise ValueError("must be a list of capability names, e.g. ['CHOWN', 'SETUID']")
        names = tuple(str(c).upper().removeprefix("CAP_") for c in v)
        unknown = sorted(set(names) - _KNOWN_CAPABILITIES)
        if unknown:
            raise ValueError(f"unknown capabilities {unknown}")
        return tuple(sorted(set(names)))

    @property
    def memory_bytes(self) -> int:
        return parse_size(self.memory)

    @property
    def disk_bytes(self) -> int | None:
        return None if self.disk is None else parse_size(self.disk)


class ResetOptions(StrictModel):
    """``env.reset(options=...)``: what the episode is about and how its sandbox starts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str = ""
    """The task text (the first observation)."""
    setup: str | list[str] | None = None
    """Command(s) run in the fresh sandbox before step 0 (each must exit 0)."""
    image: str | None = None
    """Image for this episode's sandbox (default: the env's ``SandboxConfig.image``)."""

    @classmethod
    def parse(cls, options: Any) -> ResetOptions:
        if options is None:
            return cls()
        if not isinstance(options, dict):
            raise ConfigError(f"reset options must be a dict, got {type(options).__name__}")
        return cls(**options)

    @property
    def setup_commands(self) -> list[str]:
        if isinstance(self.setup, str):
            return [self.setup] if self.setup else []
        return list(self.setup or [])
