"""Shared fixtures: a real Docker engine (never mocked). Missing engine = a loud failure."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

_KEY_DIR = pytest.StashKey["os.PathLike[str]"]()


def pytest_configure(config: pytest.Config) -> None:
    """Replicas are authenticated (``belayer_env/store/replica_auth.py``): the suite is one
    "cluster" with one key, made here (private, 0600) and inherited by Ray's workers."""
    if os.environ.get("BELAYER_REPLICA_KEY_FILE"):
        return
    import tempfile

    from belayer_env.store.replica_auth import new_key

    key = new_key(os.path.join(tempfile.mkdtemp(prefix="belayer-test-key-"), "replica.key"))
    os.environ["BELAYER_REPLICA_KEY_FILE"] = str(key)
    config.stash[_KEY_DIR] = key.parent


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    key_dir = config.stash.get(_KEY_DIR, None)
    if key_dir is not None:
        shutil.rmtree(key_dir, ignore_errors=True)


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for: {what}")
        time.sleep(interval)


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists (a zombie counts: it has not been reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session")
def docker_client():
    from belayer_core.errors import DaemonUnavailable
    from belayer_env.sandbox.docker_api import connect

    try:
        return connect()
    except DaemonUnavailable as e:
        pytest.fail(f"these tests need a running Docker engine ({e}); run `bash scripts/setup.sh`")


@pytest.fixture
def sandbox(docker_client):
    from belayer_env import DockerSandbox

    sb = DockerSandbox(client=docker_client)
    yield sb
    sb.close()
