"""The env's own rollback onto a standby, timed as the env records it (issue 35 item 4).

One ``RecoverableSandboxEnv(EnvConfig(standby=True))`` per scenario, checkpointing every
step. Each round: one step (a new boundary, captured in the background), ``settle`` and
the standby of that boundary prepared (untimed: in use this happens while the LLM
generates), the sandbox killed (untimed: the failure), then the next step: its exec fails
and the env rolls back. ``recovery_s`` is the env's own figure (``InfraEvent.recovery_s``:
from the failure's detection to the rolled-back observation: the env's bookkeeping, the
standby's fence, thaw and verify), ``parts`` the env's breakdown of it.
"""

from __future__ import annotations

import time

from belayer_env.env.policy import AlwaysPolicy
from belayer_env.env.recoverable import EnvConfig, RecoverableSandboxEnv
from belayer_env.sandbox.config import SandboxConfig

WAIT_S = 300.0


def make_env(client, run_id: str, setup: str | None, store_dir: str) -> RecoverableSandboxEnv:
    env = RecoverableSandboxEnv(EnvConfig(standby=True, checkpoint_dir=store_dir,
                                          sandbox=SandboxConfig(name_prefix=f"belayer-bench-{run_id}", timeout=120)),
                                client=client, checkpoint_policy=AlwaysPolicy())
    env.reset(options={"task": "bench", **({"setup": [setup]} if setup else {})})
    return env


def rollback_once(client, env: RecoverableSandboxEnv, i: int, out: dict) -> float:
    env.step(f"echo {i} > /tmp/env-step")
    env.settle()
    standby = env.recovery.standby
    deadline = time.monotonic() + WAIT_S
    while standby is None or not (standby.ready() or standby.error):
        assert time.monotonic() < deadline, "the env's standby was not prepared"
        time.sleep(0.05)
        standby = env.recovery.standby
    assert standby.error is None, f"standby failed: {standby.error}"
    client.api.kill(env.sandbox.container_id)  # the failure
    _, _, _, _, info = env.step("cat /tmp/env-step")
    assert info["belayer"].get("rollback"), info
    event = [e for e in env.trajectory.events if e.kind == "rollback"][-1]
    assert [e.kind for e in env.trajectory.events if e.kind.startswith("standby")][-1] == "standby_promoted"
    out.setdefault("recovery_s", []).append(event.recovery_s)
    for k, v in event.recovery_parts.items():
        out.setdefault(f"part_{k}_s", []).append(v)
    for k, v in standby.last_promote.items():
        out.setdefault(f"promote_{k}", []).append(v)
    return event.recovery_s
