"""Fixtures of the wrapper tests: real envs (real containers), closed and checked at teardown."""

from __future__ import annotations

import pytest

from tests.belayer.wrappers.extra_deps import add_minisweagent_venv
from tests.belayer_env.conftest_env import containers_of, make_env  # noqa: F401

# before any test module here imports belayer.wrappers.minisweagent: the adapter takes
# mini-swe-agent's exception classes as its bases at import when mini-swe-agent is there
add_minisweagent_venv()


@pytest.fixture
def msw_env(docker_client):
    """``msw_env(**kw)`` -> RecoverableDockerEnvironment on the base image; cleaned up and checked."""
    from belayer.wrappers.minisweagent import RecoverableDockerEnvironment

    envs = []

    def make(**kw):
        e = RecoverableDockerEnvironment(image="belayer-base:latest", **kw)
        envs.append(e)
        return e

    yield make
    for e in envs:
        name = e.env.name
        e.cleanup()
        assert not containers_of(docker_client, name), f"env {name} left containers behind"
