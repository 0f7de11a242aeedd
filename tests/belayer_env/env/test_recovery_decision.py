"""Where the env's rollback is decided: ``env/recovery.py`` alone (issue 46). The env holds its
parts instead of inheriting them, and only ``Recovery`` reaches the mechanisms a rollback
chooses between (the standby, ``full_restore``); the one other restore in the env, a resume
from a replica on another node (``resumable.py``), has no standby to choose."""

from __future__ import annotations

import pytest

from belayer_env.env.recoverable import RecoverableSandboxEnv
from belayer_env.env.resumable import ResumableSandboxEnv
from tests.test_boundaries import ROOT, _imports

ENV = ROOT / "belayer_env" / "env"


@pytest.mark.parametrize(("mechanism", "allowed"), [
    ("belayer_env.restore.standby", {"recovery.py"}),
    ("belayer_env.restore.promotion", set()),
    ("belayer_env.restore.restore", {"recovery.py", "resumable.py"}),
    ("belayer_env.restore.plan", set()),
])
def test_only_recovery_chooses_what_a_rollback_restores_into(mechanism: str, allowed: set[str]) -> None:
    users = {p.name for p in ENV.glob("*.py") if mechanism in _imports(p)}
    assert users <= allowed, f"{mechanism} used by {sorted(users - allowed)}: the rollback's decision is Recovery's"


def test_the_env_holds_its_parts_and_inherits_none() -> None:
    ours = [c.__qualname__ for c in RecoverableSandboxEnv.__mro__ if c.__module__.startswith("belayer_env")]
    assert ours == ["RecoverableSandboxEnv"], ours
    ours = [c.__qualname__ for c in ResumableSandboxEnv.__mro__ if c.__module__.startswith("belayer_env")]
    assert ours == ["ResumableSandboxEnv", "RecoverableSandboxEnv"], ours
