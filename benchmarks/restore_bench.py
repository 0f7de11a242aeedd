"""What does a restore cost: a checkpoint back into a fresh, running container?

Each round captures the sandbox (untimed: ``capture_bench.py``), then restores that
checkpoint every way, interleaved (``_checkpoint_common``: scenarios ``idle`` and ``heavy``,
an agent-like step first; each restore goes on in the container the previous one made):

- ``docker``: Docker's own restore of its own checkpoint + commit of the same boundary
  (``_docker_baseline``: create from the commit, copy the checkpoint in, ``start?checkpoint=``).
- ``belayer``: ``full_restore`` (fresh container, layer, CRIU), not pre-staged.
- ``prestaged``: the same checkpoint, ``prestage``d first (unpack + verify on Docker's disk,
  what ``start_checkpoint`` does after publish, off the critical path: reported as
  ``prestage_s``), then ``full_restore`` installs it with renames. The default image path,
  ``linked``: Docker's checkpoint directory holds only symlinks to the verified CRIU images.
- ``prestaged_lost``: the same, but the sandbox is killed first, untimed (the failure a
  rollback answers), then timed as an env rolls back (``Recovery.rollback``): its fence
  (the dead container killed and renamed aside), then the restore (the dead one's removal
  starts after it).
- ``prestaged_spare``: that, into a ``RestoreSpare``, a container created ahead (untimed, as
  ``EnvConfig(restore_spare=True)`` keeps one): the restore skips Docker's create. The three
  pre-staged restores rotate their order by round.
- ``prestaged_copied``: pre-staged, with ``images="copied"``: the images themselves go
  through Docker's start (tar -> containerd's content store -> untar), the path before
  ``linked`` (docs/restore.md).
- ``cold``: create + start a fresh container (what a restore competes with: no state).

Run: ``python3 benchmarks/restore_bench.py --runs 5`` (needs Docker + CRIU, root).
Writes ``benchmarks/results/restore_bench.json`` (+ ``.png`` with matplotlib).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_env.capture.checkpoint import full_checkpoint  # noqa: E402
from belayer_env.restore.prestaging import prestage  # noqa: E402
from belayer_env.restore.restore import full_restore  # noqa: E402
from belayer_env.restore.spare import RestoreSpare  # noqa: E402
from belayer_env.sandbox.config import SandboxConfig  # noqa: E402
from belayer_env.sandbox.container import DockerSandbox  # noqa: E402
from belayer_env.sandbox.fence import fence  # noqa: E402
from belayer_env.sandbox.fence import kill as fence_kill  # noqa: E402
from belayer_env.sandbox.removal import remove_in_background  # noqa: E402
from benchmarks import _checkpoint_common as common  # noqa: E402
from benchmarks import _docker_baseline  # noqa: E402

PRESTAGED = ("prestaged", "prestaged_lost", "prestaged_spare")


def prestaged_restore(client, sb: DockerSandbox, ck, out: dict, *, spare: bool = False, lost: bool = False,
                      images: str | None = None) -> DockerSandbox:
    """``prestage`` (timed apart) then ``full_restore`` of ``ck`` over ``sb``; ``spare``: into a
    ``RestoreSpare`` created ahead (untimed, as an env's ``restore_spare`` fills in the background);
    ``lost``: ``sb`` killed first, untimed (the failure a rollback answers, as for the standby),
    then timed what an env's rollback does: its fence (kill, rename aside), then the restore
    (the dead container's removal starts after it, as in ``Recovery.rollback``,
    ``belayer_env/env/recovery.py``)."""
    common.settle()
    t0 = time.monotonic()
    assert prestage(ck, client) is not None, "nothing pre-staged"
    out["prestage_s"].append(time.monotonic() - t0)
    ahead = RestoreSpare(sb) if spare else None
    if ahead is not None:
        ahead.fill()
        assert ahead.wait_filled(), f"the spare was not created: {ahead.error}"
    phases: list[str] = []
    common.settle()
    if lost:
        client.api.kill(sb.container_id)
    t0 = time.monotonic()
    dead = fence_kill(client, sb.name, docker_view=False) if lost else []  # as the env's rollback
    try:
        restored = full_restore(ck, client=client, phase_hook=phases.append, images=images, spare=ahead)
        out["restore_s"].append(time.monotonic() - t0)
        remove_in_background(client, dead)
        assert "staged" in phases, phases
        assert ahead is None or len(ahead) == 0, "the restore did not start in its spare"
    finally:
        if ahead is not None:
            ahead.close()
    return restored


def cold_start(client, config: SandboxConfig) -> float:
    t0 = time.monotonic()
    sb = DockerSandbox(config, client=client)
    elapsed = time.monotonic() - t0
    sb.close()
    return elapsed


def measure(run: common.Run) -> dict:
    client = run.client
    sb = common.bench_sandbox(client, run.scenario, run.run_id)
    out = {m: {"restore_s": []} for m in ("belayer", "docker", "cold")}
    out.update({m: {"prestage_s": [], "restore_s": []} for m in (*PRESTAGED, "prestaged_copied")})
    images: list[str] = []
    try:
        for i in range(run.runs):
            sb.execute(common.STEP.format(i=i))
            ck = full_checkpoint(sb, run.store)
            dk_name = f"{run.run_id}-{run.scenario}-{i}"
            dk = _docker_baseline.docker_checkpoint(client, sb, dk_name)
            images.append(dk["image"])
            common.settle()
            out["docker"]["restore_s"].append(_docker_baseline.docker_restore(client, sb, dk, dk_name))
            _docker_baseline.delete_docker_checkpoint(client, sb.container_id, dk_name)
            common.settle()
            t0 = time.monotonic()
            sb = full_restore(ck, client=client)
            out["belayer"]["restore_s"].append(time.monotonic() - t0)
            for method in PRESTAGED[i % 3:] + PRESTAGED[:i % 3]:  # side by side, order rotating by round
                sb = prestaged_restore(client, sb, ck, out[method], spare=method == "prestaged_spare",
                                       lost=method != "prestaged")
            sb = prestaged_restore(client, sb, ck, out["prestaged_copied"], images="copied")
            common.settle()
            out["cold"]["restore_s"].append(cold_start(client, sb.config))
            load = run.round_done()
            ms = {m: out[m]["restore_s"][-1] * 1e3 for m in out}
            print(f"  {run.scenario} run {i + 1}/{run.runs}: restore {ms['belayer']:.0f} ms, pre-staged "
                  f"{ms['prestaged']:.0f} ms (prestage {out['prestaged']['prestage_s'][-1] * 1e3:.0f} ms), lost "
                  f"{ms['prestaged_lost']:.0f} ms, lost into a spare {ms['prestaged_spare']:.0f} ms, pre-staged copied "
                  f"{ms['prestaged_copied']:.0f} ms | docker {ms['docker']:.0f} ms, cold {ms['cold']:.0f} ms, "
                  f"load {load:.1f}", flush=True)
    finally:
        fence(client, sb.name, background=False)
        common.fence_run(client, run.run_id)
        _docker_baseline.remove_images(client, images)
    return out


QUESTION = common.Question(
    name="restore_bench", doc=__doc__, measure=measure,
    labels={"belayer": "belayer (not pre-staged)", "prestaged": "belayer (pre-staged)",
            "prestaged_lost": "belayer (pre-staged, sandbox lost)",
            "prestaged_spare": "belayer (pre-staged, sandbox lost, into a spare created ahead)",
            "prestaged_copied": "belayer (pre-staged, copied)",
            "docker": "docker start --checkpoint", "cold": "cold create + start"},
    rows=(("prestaged_spare", "restore_s", "restore: lost, into a spare"),
          ("prestaged_lost", "restore_s", "restore: lost, pre-staged"), ("prestaged", "restore_s", "restore: pre-staged"),
          ("prestaged_copied", "restore_s", "restore: pre-staged, copied"),
          ("belayer", "restore_s", "restore: not pre-staged"),
          ("docker", "restore_s", "restore: docker start --checkpoint"), ("cold", "restore_s", "cold create + start")))


if __name__ == "__main__":
    sys.exit(common.main(QUESTION))
