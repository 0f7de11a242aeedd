"""What does a checkpoint cost: how long the sandbox is frozen, and the whole capture?

Methods, interleaved in every round (``_checkpoint_common``: scenarios ``idle`` and
``heavy``, an agent-like step first):

- ``belayer``: ``full_checkpoint`` with the default ``incremental`` capture (CRIU starts up
  while the sandbox runs, the cgroup is frozen right before CRIU seizes it, only the layer
  entries changed since the previous capture, or since the restore, are copied while frozen;
  the full layer is rebuilt after thaw); its frozen window's parts in ``belayer_detail``.
- ``paused``: ``full_checkpoint(capture="paused")`` of the same boundary, just before or
  after (order alternating by round): what Belayer did before (Docker pause -> runc/CRIU
  dump + tar of the whole upperdir -> unpause).
- ``docker``: Docker's own checkpoint + commit of the same sandbox (``_docker_baseline``).
- ``floors`` (``_floors.py``), on the same sandbox every round: the bare freezer freeze +
  thaw and a bare CRIU dump of the same process tree (CRIU's own frozen time and memory
  dump). The JSON's ``targets`` holds issue 35's target against this run's p50 with the
  floors beside it, and ``soft_dirty_estimate`` what a kernel with CONFIG_MEM_SOFT_DIRTY
  would give (an estimate from this run's pieces).

Each round ends with a restore of its checkpoint (untimed: ``restore_bench.py``), so every
capture after the first round's is of a sandbox just restored, as in an env that rolls
back (a restored sandbox's layer entries older than its restore are not copied while
frozen); the first round's incremental capture is the sandbox's first (everything copied).

Run: ``python3 benchmarks/capture_bench.py --runs 5`` (needs Docker + CRIU, root).
Writes ``benchmarks/results/capture_bench.json`` (+ ``.png`` with matplotlib).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_env.capture.checkpoint import full_checkpoint  # noqa: E402
from belayer_env.restore.restore import full_restore  # noqa: E402
from belayer_env.sandbox.container import DockerSandbox  # noqa: E402
from belayer_env.store.manifest import read_manifest  # noqa: E402
from belayer_env.store.store import CheckpointStore  # noqa: E402
from benchmarks import _checkpoint_common as common  # noqa: E402
from benchmarks import _docker_baseline, _floors  # noqa: E402

FIGURES = ("frozen_s", "total_s", "size_bytes")


def capture_pair(sb: DockerSandbox, store: CheckpointStore, i: int, out: dict) -> object:
    """The paused and the incremental capture of one boundary, in alternating order; the
    incremental checkpoint is returned."""
    sb.execute(common.STEP.format(i=i))
    order = ("paused", "belayer") if i % 2 == 0 else ("belayer", "paused")
    ck = None
    for method in order:
        common.settle()
        taken = full_checkpoint(sb, store, capture="paused" if method == "paused" else "incremental")
        for k in FIGURES:
            out[method][k].append(getattr(taken, k))
        if method == "belayer":
            ck = taken
            manifest = read_manifest(taken.path)
            detail = manifest.get("frozen_detail") or {}
            for k in ("before_freeze_s", "criu_frozen_s", "criu_memdump_s"):
                out["belayer_detail"].setdefault(k, []).append(detail.get(k, 0.0))
            out["belayer_detail"].setdefault("layer_entries_copied", []).append(manifest.get("layer_entries_copied", 0))
    return ck


def measure(run: common.Run) -> dict:
    client = run.client
    sb = common.bench_sandbox(client, run.scenario, run.run_id)
    out = {m: {k: [] for k in FIGURES} for m in ("belayer", "paused", "docker")}
    out["belayer_detail"] = {}
    out["floors"] = {}
    images: list[str] = []
    try:
        for i in range(run.runs):
            ck = capture_pair(sb, run.store, i, out)
            common.settle()
            dk_name = f"{run.run_id}-{run.scenario}-{i}"
            dk = _docker_baseline.docker_checkpoint(client, sb, dk_name)
            images.append(dk["image"])
            for k in FIGURES:
                out["docker"][k].append(dk[k])
            _docker_baseline.delete_docker_checkpoint(client, sb.container_id, dk_name)
            common.settle()
            _floors.record(out["floors"], {"freeze_thaw_s": _floors.freeze_thaw(sb), **_floors.bare_criu(sb)})
            common.settle()
            sb = full_restore(ck, client=client)  # the next round captures a restored sandbox
            load = run.round_done()
            print(f"  {run.scenario} run {i + 1}/{run.runs}: frozen incremental {out['belayer']['frozen_s'][-1] * 1e3:.0f} ms "
                  f"({out['belayer_detail']['layer_entries_copied'][-1]} entries copied), paused "
                  f"{out['paused']['frozen_s'][-1] * 1e3:.0f} ms, docker {dk['frozen_s'] * 1e3:.0f} ms; total "
                  f"{out['belayer']['total_s'][-1] * 1e3:.0f} / {out['paused']['total_s'][-1] * 1e3:.0f} ms, "
                  f"load {load:.1f}", flush=True)
    finally:
        common.fence_run(client, run.run_id)
        _docker_baseline.remove_images(client, images)
    return out


def soft_dirty(result: dict) -> None:
    result["soft_dirty_estimate"] = _floors.soft_dirty_estimate(result["scenarios"])


QUESTION = common.Question(
    name="capture_bench", doc=__doc__, measure=measure, finish=soft_dirty,
    labels={"belayer": "belayer (incremental capture)", "paused": "belayer paused capture (before)",
            "docker": "docker checkpoint + commit"},
    rows=(("belayer", "frozen_s", "frozen: incremental capture"), ("paused", "frozen_s", "frozen: paused capture"),
          ("docker", "frozen_s", "frozen: docker checkpoint"),
          ("floors", "criu_frozen_s", "floor: a bare CRIU dump, CRIU's frozen time"),
          ("floors", "freeze_thaw_s", "floor: a bare freezer freeze + thaw"),
          ("belayer", "total_s", "whole capture: incremental"),
          ("paused", "total_s", "whole capture: paused"), ("docker", "total_s", "whole capture: docker")),
    targets_ms={("belayer", "frozen_s"): (20, "heavy")},
    parts=("belayer_detail", "floors"))


if __name__ == "__main__":
    sys.exit(common.main(QUESTION))
