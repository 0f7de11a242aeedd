"""The one place where Docker SDK exceptions become Belayer's typed errors.

Everything else in ``belayer_env`` talks to Docker inside ``translate_errors`` so that a
recovery decision can key on ``SandboxLost`` / ``DaemonUnavailable`` rather than on the
SDK's exception zoo or on message text.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import docker
import docker.errors
import requests

from belayer_core.errors import DaemonUnavailable, SandboxLost

DEFAULT_SOCKET = "unix:///var/run/docker.sock"
_FIX_HINT = "start the engine with `bash scripts/setup.sh` (or `dockerd &`), then `belayer doctor`"


def docker_url(docker_host: str | None = None) -> str:
    return docker_host or os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET


def connect(docker_host: str | None = None, timeout: float = 60.0) -> docker.DockerClient:
    """A client that has answered a ping, or ``DaemonUnavailable`` saying where and how to fix."""
    url = docker_url(docker_host)
    try:
        client = docker.DockerClient(base_url=url, timeout=timeout)
        if url.startswith("unix://"):
            # no proxy or netrc applies to a unix socket: skip looking them up in the
            # environment on every request (~5% of a fork's own CPU)
            client.api.trust_env = False
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
        raise DaemonUnavailable(
            f"cannot reach the Docker daemon at {url}: {_short(e)}; {_FIX_HINT}"
        ) from e
    return client


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _looks_gone(e: docker.errors.APIError) -> bool:
    msg = str(getattr(e, "explanation", "") or e).lower()
    return any(s in msg for s in ("is not running", "no such container", "is paused", "is restarting", "marked for removal", "dead or marked"))


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Map SDK/transport errors raised while doing ``what`` to InfraError subclasses."""
    try:
        yield
    except docker.errors.NotFound as e:
        raise SandboxLost(f"{what}: container no longer exists ({_short(e)})") from e
    except docker.errors.APIError as e:
        if e.status_code == 409 or _looks_gone(e):
            raise SandboxLost(f"{what}: container is not running ({_short(e)})") from e
        raise DaemonUnavailable(f"{what}: Docker daemon error ({_short(e)})") from e
    except (requests.exceptions.ConnectionError, ConnectionError, BrokenPipeError) as e:
        raise DaemonUnavailable(f"{what}: lost the connection to the Docker daemon ({_short(e)}); {_FIX_HINT}") from e
    except requests.exceptions.RequestException as e:
        raise DaemonUnavailable(f"{what}: Docker API request failed ({_short(e)})") from e
    except docker.errors.DockerException as e:
        raise DaemonUnavailable(f"{what}: {_short(e)}") from e
