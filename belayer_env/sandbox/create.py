"""``create_container``: the one recipe of a sandbox container, shared by ``DockerSandbox``,
``full_restore``, the restore spare and the fork pool.

It creates (never starts) a container from a ``SandboxConfig``: the sandbox's init and
private tmpfs (``config``), no network, memory, pids and CPU limits, every capability
dropped but the config's, no new privileges, labelled with its owner, and with
``config.disk`` the writable layer on a file system of that size (``disk.limit_layer``)
before anything runs. docs/env.md, "Sandbox limits".
"""

from __future__ import annotations

import contextlib
from typing import Any

import docker

from belayer_core.errors import ConfigError, UsageError
from belayer_env.host import loopback
from belayer_env.sandbox.config import INIT_COMMAND, OUTPUT_TMPFS, SandboxConfig
from belayer_env.sandbox.disk import limit_layer
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.ownership import owner_labels


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
