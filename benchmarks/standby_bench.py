"""What does a rollback onto a standby cost: the promotion alone, and the env's whole recovery?

Each round captures the sandbox (untimed: ``capture_bench.py``; ``_checkpoint_common``:
scenarios ``idle`` and ``heavy``, an agent-like step first), then:

- ``standby``: the checkpoint restored ahead of time into a frozen standby (``prepare_s``,
  off the critical path); the sandbox is then lost (killed, untimed: the failure), and the
  rollback is ``Standby.promote`` (``restore_s``), its phases in ``standby_phases``: the
  fence (the listing taken ahead, checked through the cgroups, each init SIGKILLed), the
  thaw (the freezer cgroup), the verify (the init alive in it), and apart, after the
  critical path, Docker's renames (``names_s``).
- ``env_standby``: an env's own rollback onto its standby, as the env records it
  (``_env_rollback.py``: ``InfraEvent.recovery_s`` and its parts).
- ``floors`` (``_floors.py``), on the same sandbox every round: the bare freezer freeze +
  thaw, one Docker listing and ping. The JSON's ``targets`` holds issue 35's targets
  against this run's p50 with the floors beside them.

Run: ``python3 benchmarks/standby_bench.py --runs 5`` (needs Docker + CRIU, root).
Writes ``benchmarks/results/standby_bench.json`` (+ ``.png`` with matplotlib).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_env.capture.checkpoint import full_checkpoint  # noqa: E402
from belayer_env.restore.standby import Standby  # noqa: E402
from belayer_env.sandbox.container import DockerSandbox  # noqa: E402
from belayer_env.sandbox.fence import fence  # noqa: E402
from benchmarks import _checkpoint_common as common  # noqa: E402
from benchmarks import _env_rollback, _floors  # noqa: E402


def standby_rollback(client, sb: DockerSandbox, ck, phases: dict) -> tuple[DockerSandbox, float, float]:
    """Prepare a standby of ``ck`` (untimed in real use: background), then roll ``sb`` onto it;
    ``phases`` gets the promotion's (``Standby.last_promote``: fence, thaw, verify on the
    critical path; Docker's renames after it)."""
    st = Standby(client)
    st.prepare(ck)
    deadline = time.monotonic() + common.WAIT_S
    while not (st.ready() or st.error):
        if time.monotonic() > deadline:
            raise RuntimeError(f"standby not prepared after {common.WAIT_S:g} s")
        time.sleep(0.05)
    if st.error is not None:
        raise RuntimeError(f"standby failed: {st.error}")
    client.api.kill(sb.container_id)  # the failure a rollback answers: the sandbox is lost
    t0 = time.monotonic()
    promoted = st.promote(ck, sb.name)
    elapsed = time.monotonic() - t0
    assert promoted is not None and promoted.is_alive(), "standby not promoted"
    assert promoted.execute("true")["returncode"] == 0, "the promoted standby does not run commands"
    common.settle()  # Docker's renames (queued off the critical path) done: names_s is set
    phases.update(st.last_promote)
    return promoted, st.prepare_s or 0.0, elapsed


def measure(run: common.Run) -> dict:
    client = run.client
    sb = common.bench_sandbox(client, run.scenario, run.run_id)
    out = {"standby": {"prepare_s": [], "restore_s": []}, "standby_phases": {}, "env_standby": {}, "floors": {}}
    env = _env_rollback.make_env(client, run.run_id, common.HEAVY_SETUP if run.scenario == "heavy" else None,
                                 str(run.store.path / f"env-{run.scenario}"))
    try:
        for i in range(run.runs):
            sb.execute(common.STEP.format(i=i))
            ck = full_checkpoint(sb, run.store)
            common.settle()
            phases: dict = {}
            sb, prepare_s, rollback_s = standby_rollback(client, sb, ck, phases)
            out["standby"]["prepare_s"].append(prepare_s)
            out["standby"]["restore_s"].append(rollback_s)
            for k, v in phases.items():
                out["standby_phases"].setdefault(k, []).append(v)
            common.settle()
            env_s = _env_rollback.rollback_once(client, env, i, out["env_standby"])
            common.settle()
            _floors.record(out["floors"], {"freeze_thaw_s": _floors.freeze_thaw(sb),
                                           **_floors.docker_round_trips(client, sb)})
            load = run.round_done()
            print(f"  {run.scenario} run {i + 1}/{run.runs}: standby rollback {rollback_s * 1e3:.1f} ms (prepare "
                  f"{prepare_s * 1e3:.0f} ms), env rollback onto its standby {env_s * 1e3:.1f} ms, load {load:.1f}",
                  flush=True)
    finally:
        env.close()
        fence(client, sb.name, background=False)
        common.fence_run(client, run.run_id)
    return out


QUESTION = common.Question(
    name="standby_bench", doc=__doc__, measure=measure,
    labels={"standby": "belayer (standby)"},
    rows=(("env_standby", "recovery_s", "env rollback onto a standby"),
          ("standby", "restore_s", "rollback onto a standby (promote)"),
          ("floors", "freeze_thaw_s", "floor: a bare freezer freeze + thaw"),
          ("floors", "docker_list_s", "one fence listing through Docker (moved off)"),
          ("standby", "prepare_s", "standby prepared ahead (off the critical path)")),
    targets_ms={("standby", "restore_s"): (5, None), ("env_standby", "recovery_s"): (5, None)},
    parts=("env_standby", "standby_phases", "floors"))


if __name__ == "__main__":
    sys.exit(common.main(QUESTION))
