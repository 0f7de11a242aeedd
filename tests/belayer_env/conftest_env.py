"""Fixtures of the env tests: real envs over real containers, removed (and checked) at teardown."""

from __future__ import annotations

import pytest

from belayer_env.sandbox.fence import sandbox_containers

INFRA_WORDS = ("SandboxLost", "DaemonUnavailable", "RestoreFailed", "CheckpointFailed", "InjectedFault",
               "Docker", "docker", "container", "Traceback", "OOM", "memory limit")


def containers_of(client, name: str) -> list[dict]:
    return sandbox_containers(client, name)


@pytest.fixture
def make_env(docker_client):
    """``make_env(**kwargs)`` -> RecoverableSandboxEnv; every env is closed, its containers must be gone."""
    from belayer_env.env.recoverable import RecoverableSandboxEnv

    envs = []

    def make(**kwargs):
        env = RecoverableSandboxEnv(client=docker_client, **kwargs)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()
        assert not containers_of(docker_client, env.name), f"env {env.name} left containers behind"


def assert_no_infra_text(observation: str) -> None:
    for word in INFRA_WORDS:
        assert word not in observation, f"infra text {word!r} reached an observation: {observation[:300]!r}"
