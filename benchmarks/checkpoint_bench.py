"""Full checkpoint / restore benchmark: Belayer vs Docker's own way vs a cold container.

Scenarios: (a) ``idle``: a fresh shell container; (b) ``heavy``: a python process holding a
50 MiB heap (random bytes, so every page is real) plus a git repo of ~2,000 files with
~20 MiB of changes in the writable layer. Methods, interleaved in every round:

- ``belayer``: ``full_checkpoint`` with the default ``incremental`` capture (CRIU starts up
  while the sandbox runs, the cgroup is frozen right before CRIU seizes it, only the layer
  entries changed since the previous capture, or since the restore, are copied while frozen;
  the full layer is rebuilt after thaw) and ``full_restore`` (fresh container, layer, CRIU).
- ``paused``: ``full_checkpoint(capture="paused")`` of the same boundary, just before (order
  alternating by round): what Belayer did before (Docker pause -> runc/CRIU dump + tar of
  the whole upperdir -> unpause). Frozen time side by side with ``belayer``.
- ``belayer (pre-staged)``: the same checkpoint, ``prestage``d first (unpack + verify on
  Docker's disk, what ``start_checkpoint`` does after publish, off the critical path:
  reported as ``prestage_s``), then ``full_restore`` installs it with renames. Both use
  the default image path, ``linked``: Docker's checkpoint directory holds only symlinks
  to the verified CRIU images.
- ``belayer (pre-staged, copied)``: the same, with ``images="copied"``: the images
  themselves go through Docker's start (tar -> containerd's content store -> untar), the
  path before ``linked`` (docs/restore.md).
- ``belayer (pre-staged, sandbox lost)``: the same, but the sandbox is killed first, untimed
  (the failure a rollback answers, as for ``standby``), then timed as an env rolls back: its
  fence (the dead container killed and renamed aside), then the restore (the dead one's
  removal starts after it).
- ``belayer (pre-staged, sandbox lost, into a spare)``: that, into a ``RestoreSpare``, a
  container created ahead (untimed, as ``EnvConfig(restore_spare=True)`` keeps one): the
  restore skips Docker's create. The three pre-staged restores rotate their order by round.
- ``docker``: the naive way: pause -> ``POST /containers/{id}/checkpoints`` (leave running)
  -> ``docker commit --pause=false`` -> unpause; restore = create from the commit, copy the
  checkpoint in, ``start?checkpoint=``.
- ``standby``: the checkpoint restored ahead of time into a frozen standby (``prepare_s``, off
  the critical path); the sandbox is then lost (killed, untimed: the failure), and the
  rollback is ``Standby.promote`` (``restore_s``), its phases in ``standby_phases``: the
  fence (the listing taken ahead, checked through the cgroups, each init SIGKILLed), the
  thaw (the freezer cgroup), the verify (the init alive in it), and apart, after the
  critical path, Docker's renames (``names_s``). The other restores fence a live sandbox
  inside their timing (~0.1 s of ``docker kill`` under load).
- ``fork``: ``fork(checkpoint, n)`` (``--fork-n``, default 8): n sandboxes from one
  checkpoint, side by side, sharing its layer as a read-only overlay lower layer
  (unpacked once); ``restore_s`` is the time until all n run.
- ``fork_copied``: ``fork(checkpoint, n, share=False)``: the same, each fork unpacking its
  own copy of the layer (what ``fork`` did before); order with ``fork`` alternating by round.
- ``fork_pooled``: ``fork(checkpoint, n, pool=pool)`` into a ``ForkPool`` of n containers
  created ahead from the sandbox (untimed, as an env's ``fork_pool`` fills in the background):
  the forks only start; order with the others rotating by round.
- ``fork_ahead``: the same, the pool having also verified the checkpoint's shared layer and
  runtime images ahead (``ForkPool.prepare``, as ``EnvConfig(fork_pool=n)`` does when a
  checkpoint is published; ``prepare_s``, untimed in use): the call only starts containers.
- ``fork_warm``: ``warm_forks(checkpoint, n)``: the n forks restored ahead and frozen
  (``prepare_s``, untimed in use), then ``fork(checkpoint, n, warm=...)``: n thaws and checks
  (``thaw_s``, ``verify_s``).
- ``cold``: create + start a fresh container (what a restore competes with: no state).
- ``floors`` (``_floors.py``), on the same sandbox every round: the bare freezer freeze +
  thaw, a bare CRIU dump of the same process tree (CRIU's own frozen time and memory dump),
  one Docker listing and ping, n plain containers started side by side. The JSON's
  ``targets`` holds issue 35's targets against this run's p50 with the floor beside each, and
  ``soft_dirty_estimate`` what a kernel with CONFIG_MEM_SOFT_DIRTY would give (an estimate
  from this run's pieces).

The machine may be shared: the load average is recorded at the start and after every run
(``host.loadavg``); under load compare the methods side by side (same run, interleaved),
not with figures from another machine.

Each round starts with an agent-like step (a few small files written) so there is something to
capture. ``--capture-only``: only the two captures and the restore, per round (short runs).
``--fork-only``: only a capture and the three forks (shared, copied, pooled), per round.
``--restore-only``: only a capture and the three pre-staged restores (live, lost, spare), per round.

Every timed call starts once the previous one's background work has finished (``settle``:
a fenced container's removal, a restore's spent copies and the write-back of what a prestage
or a restore wrote go on threads, off the critical path; a heavy container's removal takes
seconds and would otherwise land in the next call).

Run: ``python benchmarks/checkpoint_bench.py --runs 10`` (needs Docker + CRIU, root). It runs again and
again on one machine: every name it creates (containers, Docker checkpoints, images) carries a
run id, every checkpoint copy it restores from carries a nonce file (Docker uploads the
directory to containerd's content store by digest: two identical copies, or one a crashed run
left there, collide with "content ... already exists"), and it removes what it made, containerd's
unpacked copies of the checkpoints included (``belayer_env.restore.ctrd_copies``).
Writes ``benchmarks/results/checkpoint_bench.json`` (+ ``.png`` with matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.forks.fork import fork, warm_forks  # noqa: E402
from belayer_env.forks.pool import ForkPool, RestoreSpare  # noqa: E402
from belayer_env.ops.gc import sweep_shared_layers  # noqa: E402
from belayer_env.restore.cleanup import wait_cleaned  # noqa: E402
from belayer_env.restore.ctrd_copies import remove as remove_ctrd_copy  # noqa: E402
from belayer_env.restore.ctrd_copies import write_nonce  # noqa: E402
from belayer_env.restore.prestaging import prestage
from belayer_env.restore.restore import full_restore  # noqa: E402
from belayer_env.restore.standby import Standby  # noqa: E402
from belayer_env.sandbox.config import SandboxConfig  # noqa: E402
from belayer_env.sandbox.container import DockerSandbox, create_container  # noqa: E402
from belayer_env.sandbox.docker_api import connect  # noqa: E402
from belayer_env.sandbox.fence import fence, remove_in_background, wait_removed  # noqa: E402
from belayer_env.sandbox.fence import kill as fence_kill  # noqa: E402
from belayer_env.sandbox.writeback import wait_flushed  # noqa: E402
from belayer_env.store.manifest import read_manifest, read_manifest_digest  # noqa: E402
from belayer_env.store.store import (
    CheckpointStore,  # noqa: E402
    owner_tag,  # noqa: E402
)
from benchmarks import _env_rollback, _floors  # noqa: E402
from benchmarks._plotting import save_result  # noqa: E402

HEAVY_SETUP = r"""
set -e
mkdir -p /repo && cd /repo && git init -q . && git config user.email b@b && git config user.name b
python3 - <<'PY'
import os, base64
for i in range(2000):
    d = f"pkg{i % 40}"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/mod{i}.py", "w") as f:   # ~10 KiB of text per file: ~20 MiB in all
        f.write(base64.b64encode(os.urandom(7600)).decode())
PY
git add -A && git commit -qm init
setsid python3 -c 'import os, time; heap = bytearray(os.urandom(50 << 20)); open("/tmp/ready", "w").close(); time.sleep(1e9)' >/dev/null 2>&1 </dev/null &
for i in $(seq 100); do [ -e /tmp/ready ] && exit 0; sleep 0.1; done; exit 1
"""


METHODS = ("belayer", "paused", "prestaged", "prestaged_lost", "prestaged_spare", "prestaged_copied", "standby", "fork",
           "fork_copied", "fork_pooled", "fork_ahead", "fork_warm", "docker", "cold")
STEP = "mkdir -p /work/steps && for i in 1 2 3 4 5; do echo {i} >> /work/steps/log$i; done && echo {i} > /work/steps/last"
"""An agent-like step before every capture: a few small files appended to or rewritten."""
LABELS = {"belayer": "belayer (incremental capture)", "paused": "belayer paused capture (before)",
          "prestaged": "belayer (pre-staged)", "prestaged_copied": "belayer (pre-staged, copied)",
          "prestaged_lost": "belayer (pre-staged, sandbox lost)",
          "prestaged_spare": "belayer (pre-staged, sandbox lost, into a spare created ahead)",
          "standby": "belayer (standby)",
          "fork": "belayer fork x N (all, shared)", "fork_copied": "belayer fork x N (all, copied)",
          "fork_pooled": "belayer fork x N (all, shared, into a pool created ahead)",
          "fork_ahead": "belayer fork x N (into a pool, its layer and images verified ahead)",
          "fork_warm": "belayer fork x N (restored ahead and frozen: a thaw each)",
          "docker": "docker checkpoint + commit", "cold": "cold create + start"}
STANDBY_WAIT_S = 300.0


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def settle() -> None:
    """Before each timed call: the previous one's work moved off its critical path (a fenced
    container's removal, seconds for a heavy layer; spent copies) has finished, so it does not
    land in this one's time (in an agent loop rollbacks are seconds apart)."""
    assert wait_cleaned() and wait_removed() and wait_flushed(), "background work of the previous call did not finish"


def docker_checkpoint(client, sb: DockerSandbox, name: str) -> dict:
    api, cid = client.api, sb.container_id
    t0 = time.monotonic()
    api.pause(cid)
    res = api.post(api._url("/containers/{0}/checkpoints", cid), data=json.dumps({"CheckpointID": name, "Exit": False}),
                   headers={"Content-Type": "application/json"})
    api._raise_for_status(res)
    image = api.commit(cid, repository="belayer-bench", tag=name, pause=False)["Id"]
    api.unpause(cid)
    frozen = time.monotonic() - t0
    ckdir = Path(client.info()["DockerRootDir"]) / "containers" / cid / "checkpoints" / name
    layer = client.api.inspect_image(image)["Size"] - client.api.inspect_image(sb.config.image)["Size"]
    return {"frozen_s": frozen, "total_s": frozen, "size_bytes": dir_size(ckdir) + max(layer, 0),
            "image": image, "ckdir": ckdir}


def docker_restore(client, sb: DockerSandbox, ck: dict, name: str) -> float:
    t0 = time.monotonic()
    config = sb.config.model_copy(update={"image": ck["image"]})
    c = create_container(client, config, f"{sb.name}-dk-{name}")
    dest = Path(client.info()["DockerRootDir"]) / "containers" / c.id / "checkpoints" / name
    shutil.copytree(ck["ckdir"], dest)
    nonce = write_nonce(dest)  # a unique digest in containerd's store; names its unpacked copy
    api = client.api
    try:
        api._raise_for_status(api.post(api._url("/containers/{0}/start", c.id), params={"checkpoint": name}))
        return time.monotonic() - t0
    finally:
        api.remove_container(c.id, force=True)
        remove_ctrd_copy(nonce)  # containerd never removes it


def delete_docker_checkpoint(client, cid: str, name: str) -> None:
    api = client.api
    with contextlib.suppress(Exception):  # best effort: it goes with the container anyway
        api._raise_for_status(api.delete(api._url("/containers/{0}/checkpoints/{1}", cid, name)))


def cold_start(client, config: SandboxConfig) -> float:
    t0 = time.monotonic()
    sb = DockerSandbox(config, client=client)
    elapsed = time.monotonic() - t0
    sb.close()
    return elapsed


def standby_rollback(client, sb: DockerSandbox, ck, phases: dict) -> tuple[DockerSandbox, float, float]:
    """Prepare a standby of ``ck`` (untimed in real use: background), then roll ``sb`` onto it;
    ``phases`` gets the promotion's (``Standby.last_promote``: fence, thaw, verify on the
    critical path; Docker's renames after it)."""
    st = Standby(client)
    st.prepare(ck)
    deadline = time.monotonic() + STANDBY_WAIT_S
    while not (st.ready() or st.error):
        if time.monotonic() > deadline:
            raise RuntimeError(f"standby not prepared after {STANDBY_WAIT_S:g} s")
        time.sleep(0.05)
    if st.error is not None:
        raise RuntimeError(f"standby failed: {st.error}")
    client.api.kill(sb.container_id)  # the failure a rollback answers: the sandbox is lost
    t0 = time.monotonic()
    promoted = st.promote(ck, sb.name)
    elapsed = time.monotonic() - t0
    assert promoted is not None and promoted.is_alive(), "standby not promoted"
    assert promoted.execute("true")["returncode"] == 0, "the promoted standby does not run commands"
    settle()  # Docker's renames (queued off the critical path) done: names_s is set
    phases.update(st.last_promote)
    return promoted, st.prepare_s or 0.0, elapsed


def fork_all(client, ck, n: int, share: bool = True, pool: ForkPool | None = None) -> float:
    waiting = set(pool.container_ids()) if pool is not None else set()
    settle()
    t0 = time.monotonic()
    forks = fork(ck, n, client=client, share=share, pool=pool)
    elapsed = time.monotonic() - t0
    assert not pool or {f.container_id for f in forks} == waiting, "a fork did not start in a pooled container"
    for f in forks:
        assert f.is_alive(), f"fork {f.name} is not running"
        assert (f.shared_lower is not None) == share, f"fork {f.name}: shared {f.shared_lower}, asked {share}"
        fence(client, f.name, background=False)
    sweep_shared_layers(client)  # its shared layer, now unused: not left to the next fork
    return elapsed


def prepare_ahead(pool: ForkPool, ck) -> float:
    """``pool.prepare(ck)`` and wait until it is done (as ``EnvConfig(fork_pool=n)`` prepares
    each published checkpoint, in the background); returns the seconds it took."""
    t0 = time.monotonic()
    pool.prepare(ck)
    assert pool.ahead.borrow(ck, read_manifest_digest(Path(ck.path))[1]) is not None, "nothing prepared"
    took = time.monotonic() - t0
    pool.ahead.give_back()
    return took


def fork_pooled(client, sb: DockerSandbox, ck, n: int, out: dict | None = None) -> float:
    """``fork`` into a full pool of ``n`` containers created ahead from ``sb`` (untimed);
    with ``out`` (``fork_ahead``) the pool also verified the checkpoint's shared layer and
    images ahead (``ForkPool.prepare``, as ``EnvConfig(fork_pool=n)`` does on publication;
    its time, untimed in use, goes to ``out["prepare_s"]``)."""
    pool = ForkPool(sb, n)
    try:
        pool.fill()
        if out is not None:
            settle()
            out["prepare_s"].append(prepare_ahead(pool, ck))
        assert pool.wait_filled(), f"the fork pool did not fill: {pool.error}"
        return fork_all(client, ck, n, pool=pool)
    finally:
        pool.close()
        if out is not None:
            sweep_shared_layers(client)  # the copy the pool held ahead: unused now, not left to the next fork


def fork_warm(client, ck, n: int, out: dict) -> float:
    """``warm_forks(ck, n)`` (untimed: ``prepare_s``, in use while the LLM generates), then the
    timed ``fork(ck, n, warm=...)``: n thaws; its phases go to ``thaw_s`` and ``verify_s``."""
    settle()
    t0 = time.monotonic()
    warm = warm_forks(ck, n, client=client)
    try:
        assert warm.done.wait(STANDBY_WAIT_S) and warm.ready(), f"warm forks not prepared: {warm.error}"
        out["prepare_s"].append(time.monotonic() - t0)
        settle()
        t0 = time.monotonic()
        forks = fork(ck, n, client=client, warm=warm)
        elapsed = time.monotonic() - t0
        assert warm.last_take, "the forks were not the warm ones"
        for k in ("thaw_s", "verify_s"):
            out[k].append(warm.last_take[k])
        for f in forks:
            assert f.execute("true")["returncode"] == 0, f"fork {f.name} does not run commands"
            fence(client, f.name, background=False)
    finally:
        warm.close()
        sweep_shared_layers(client)
    return elapsed


FORK_METHODS = ("fork", "fork_copied", "fork_pooled", "fork_ahead", "fork_warm")


def fork_pair(client, sb: DockerSandbox, ck, n: int, i: int, out: dict) -> None:
    """Every fork method of one checkpoint, the order rotating by round."""
    k = i % len(FORK_METHODS)
    for method in FORK_METHODS[k:] + FORK_METHODS[:k]:
        if method == "fork_warm":
            took = fork_warm(client, ck, n, out[method])
        elif method in ("fork_pooled", "fork_ahead"):
            took = fork_pooled(client, sb, ck, n, out[method] if method == "fork_ahead" else None)
        else:
            took = fork_all(client, ck, n, share=method == "fork")
        out[method]["restore_s"].append(took)


def run_fork_only(client, scenario: str, runs: int, store: CheckpointStore, run_id: str, fork_n: int,
                  loads: list) -> dict:
    sb = bench_sandbox(client, scenario, run_id)
    out = {"fork": {"restore_s": []}, "fork_copied": {"restore_s": []}, "fork_pooled": {"restore_s": []},
           "fork_ahead": {"restore_s": [], "prepare_s": []}, "belayer": {"size_bytes": []},
           "fork_warm": {"restore_s": [], "prepare_s": [], "thaw_s": [], "verify_s": []}}
    try:
        for i in range(runs):
            sb.execute(STEP.format(i=i))
            ck = full_checkpoint(sb, store)
            out["belayer"]["size_bytes"].append(ck.size_bytes)
            fork_pair(client, sb, ck, fork_n, i, out)
            loads.append(os.getloadavg())
            print(f"  {scenario} run {i + 1}/{runs}: fork x{fork_n} shared {out['fork']['restore_s'][-1] * 1e3:.0f} ms,"
                  f" copied {out['fork_copied']['restore_s'][-1] * 1e3:.0f} ms,"
                  f" pooled {out['fork_pooled']['restore_s'][-1] * 1e3:.0f} ms,"
                  f" pooled + prepared ahead {out['fork_ahead']['restore_s'][-1] * 1e3:.0f} ms, load {loads[-1][0]:.1f}",
                  flush=True)
    finally:
        for c in client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"}):
            fence(client, c["Names"][0].lstrip("/"), background=False)
        sweep_shared_layers(client)
    return out


def run_restore_only(client, scenario: str, runs: int, store: CheckpointStore, run_id: str, loads: list) -> dict:
    """A capture, then the three pre-staged restores (sandbox live, lost, lost into a spare), per round."""
    sb = bench_sandbox(client, scenario, run_id)
    methods = ("prestaged", "prestaged_lost", "prestaged_spare")
    out = {m: {"prestage_s": [], "restore_s": []} for m in methods}
    try:
        for i in range(runs):
            sb.execute(STEP.format(i=i))
            ck = full_checkpoint(sb, store)
            for method in methods[i % 3:] + methods[:i % 3]:
                sb = prestaged_restore(client, sb, ck, out[method], spare=method == "prestaged_spare",
                                       lost=method != "prestaged")
            loads.append(os.getloadavg())
            print(f"  {scenario} run {i + 1}/{runs}: pre-staged {out['prestaged']['restore_s'][-1] * 1e3:.0f} ms, lost "
                  f"{out['prestaged_lost']['restore_s'][-1] * 1e3:.0f} ms, lost into a spare "
                  f"{out['prestaged_spare']['restore_s'][-1] * 1e3:.0f} ms, load {loads[-1][0]:.1f}", flush=True)
    finally:
        fence(client, sb.name, background=False)
        for c in client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"}):
            fence(client, c["Names"][0].lstrip("/"), background=False)
    return out


def capture_pair(sb: DockerSandbox, store: CheckpointStore, i: int, out: dict) -> object:
    """The paused and the incremental capture of one boundary, in alternating order; the
    incremental checkpoint is returned (what the rest of the round restores)."""
    sb.execute(STEP.format(i=i))
    order = ("paused", "belayer") if i % 2 == 0 else ("belayer", "paused")
    ck = None
    for method in order:
        settle()
        taken = full_checkpoint(sb, store, capture="paused" if method == "paused" else "incremental")
        for k in ("frozen_s", "total_s", "size_bytes"):
            out[method][k].append(getattr(taken, k))
        if method == "belayer":
            ck = taken
            detail = read_manifest(taken.path).get("frozen_detail") or {}
            for k in ("before_freeze_s", "criu_frozen_s", "criu_memdump_s"):
                out["belayer_detail"].setdefault(k, []).append(detail.get(k, 0.0))
            out["belayer_detail"].setdefault("layer_entries_copied", []).append(
                read_manifest(taken.path).get("layer_entries_copied", 0))
    return ck


def bench_sandbox(client, scenario: str, run_id: str) -> DockerSandbox:
    """A fresh sandbox of ``scenario`` (``heavy``: its heap and repo set up), named for this run."""
    sb = DockerSandbox(client=client, timeout=120, name_prefix=f"belayer-bench-{run_id}")
    if scenario == "heavy":
        r = sb.execute(HEAVY_SETUP)
        assert r["returncode"] == 0, r["output"][-2000:]
    return sb


def run_capture_only(client, scenario: str, runs: int, store: CheckpointStore, run_id: str, loads: list) -> dict:
    sb = bench_sandbox(client, scenario, run_id)
    out = {m: {k: [] for k in ("frozen_s", "total_s", "size_bytes")} for m in ("belayer", "paused")}
    out["belayer"]["restore_s"] = []
    out["belayer_detail"] = {}
    try:
        full_checkpoint(sb, store)  # the sandbox's first capture (everything copied): not measured
        for i in range(runs):
            ck = capture_pair(sb, store, i, out)
            if i % 2 == 1:  # every other round goes on from a restore (its next capture compares with it)
                settle()
                t0 = time.monotonic()
                sb = full_restore(ck, client=client)
                out["belayer"]["restore_s"].append(time.monotonic() - t0)
            loads.append(os.getloadavg())
            print(f"  {scenario} run {i + 1}/{runs}: frozen incremental {out['belayer']['frozen_s'][-1] * 1e3:.0f} ms "
                  f"({out['belayer_detail']['layer_entries_copied'][-1]} entries copied), paused "
                  f"{out['paused']['frozen_s'][-1] * 1e3:.0f} ms; total {out['belayer']['total_s'][-1] * 1e3:.0f} / "
                  f"{out['paused']['total_s'][-1] * 1e3:.0f} ms, load {loads[-1][0]:.1f}", flush=True)
    finally:
        for c in client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"}):
            fence(client, c["Names"][0].lstrip("/"), background=False)
    return out


def prestaged_restore(client, sb: DockerSandbox, ck, out: dict, *, spare: bool = False, lost: bool = False,
                      images: str | None = None) -> DockerSandbox:
    """``prestage`` (timed apart) then ``full_restore`` of ``ck`` over ``sb``; ``spare``: into a
    ``RestoreSpare`` created ahead (untimed, as an env's ``restore_spare`` fills in the background);
    ``lost``: ``sb`` killed first, untimed (the failure a rollback answers, as for the standby),
    then timed what an env's rollback does: its fence (kill, rename aside), then the restore
    (the dead container's removal starts after it, as in ``RecoverableSandboxEnv._recover``)."""
    settle()
    t0 = time.monotonic()
    assert prestage(ck, client) is not None, "nothing pre-staged"
    out["prestage_s"].append(time.monotonic() - t0)
    ahead = RestoreSpare(sb) if spare else None
    if ahead is not None:
        ahead.fill()
        assert ahead.wait_filled(), f"the spare was not created: {ahead.error}"
    phases: list[str] = []
    settle()
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


def run_scenario(client, scenario: str, runs: int, store: CheckpointStore, run_id: str, fork_n: int,
                 loads: list) -> dict:
    sb = bench_sandbox(client, scenario, run_id)
    out = {m: {k: [] for k in ("frozen_s", "total_s", "restore_s", "size_bytes")} for m in ("belayer", "docker")}
    out["paused"] = {k: [] for k in ("frozen_s", "total_s", "size_bytes")}
    out["belayer_detail"] = {}
    out["prestaged"] = {k: [] for k in ("frozen_s", "total_s", "prestage_s", "restore_s", "size_bytes")}
    out["prestaged_copied"] = {"prestage_s": [], "restore_s": []}
    out["prestaged_lost"] = {"prestage_s": [], "restore_s": []}
    out["prestaged_spare"] = {"prestage_s": [], "restore_s": []}
    out["cold"] = {"restore_s": []}
    out["standby"] = {"prepare_s": [], "restore_s": []}
    out["standby_phases"] = {}
    out["floors"] = {}
    out["env_standby"] = {}
    out["fork"] = {"restore_s": []}
    out["fork_copied"] = {"restore_s": []}
    out["fork_pooled"] = {"restore_s": []}
    out["fork_ahead"] = {"restore_s": [], "prepare_s": []}
    out["fork_warm"] = {"restore_s": [], "prepare_s": [], "thaw_s": [], "verify_s": []}
    images: list[str] = []
    env = _env_rollback.make_env(client, run_id, HEAVY_SETUP if scenario == "heavy" else None,
                                 str(store.path / f"env-{scenario}"))
    try:
        for i in range(runs):
            ck = capture_pair(sb, store, i, out)
            dk_name = f"{run_id}-{scenario}-{i}"
            dk = docker_checkpoint(client, sb, dk_name)
            images.append(dk["image"])
            for k in ("frozen_s", "total_s", "size_bytes"):
                out["docker"][k].append(dk[k])
            settle()
            out["docker"]["restore_s"].append(docker_restore(client, sb, dk, dk_name))
            delete_docker_checkpoint(client, sb.container_id, dk_name)
            settle()
            t0 = time.monotonic()
            sb = full_restore(ck, client=client)
            out["belayer"]["restore_s"].append(time.monotonic() - t0)
            methods = ("prestaged", "prestaged_lost", "prestaged_spare")
            for method in methods[i % 3:] + methods[:i % 3]:  # side by side, order rotating by round
                sb = prestaged_restore(client, sb, ck, out[method], spare=method == "prestaged_spare",
                                       lost=method != "prestaged")
            for k in ("frozen_s", "total_s", "size_bytes"):
                out["prestaged"][k].append(getattr(ck, k))
            sb = prestaged_restore(client, sb, ck, out["prestaged_copied"], images="copied")
            settle()
            phases: dict = {}
            sb, prepare_s, rollback_s = standby_rollback(client, sb, ck, phases)
            out["standby"]["prepare_s"].append(prepare_s)
            out["standby"]["restore_s"].append(rollback_s)
            for k, v in phases.items():
                out["standby_phases"].setdefault(k, []).append(v)
            settle()
            _env_rollback.rollback_once(client, env, i, out["env_standby"])
            settle()
            _floors.measure(client, sb, fork_n, out["floors"])
            if fork_n:
                fork_pair(client, sb, ck, fork_n, i, out)
            settle()
            out["cold"]["restore_s"].append(cold_start(client, sb.config))
            loads.append(os.getloadavg())
            print(f"  {scenario} run {i + 1}/{runs}: standby rollback {rollback_s * 1e3:.0f} ms (prepare "
                  f"{prepare_s * 1e3:.0f} ms), fork x{fork_n} "
                  f"{(out['fork']['restore_s'] or [0])[-1] * 1e3:.0f} ms, cold {out['cold']['restore_s'][-1] * 1e3:.0f} ms,"
                  f" load {loads[-1][0]:.1f}", flush=True)
            print(f"  {scenario} run {i + 1}/{runs}: belayer frozen {ck.frozen_s * 1e3:.0f} ms, total "
                  f"{ck.total_s * 1e3:.0f} ms, restore {out['belayer']['restore_s'][-1] * 1e3:.0f} ms, pre-staged "
                  f"{out['prestaged']['restore_s'][-1] * 1e3:.0f} ms (prestage {out['prestaged']['prestage_s'][-1] * 1e3:.0f}"
                  f" ms), lost {out['prestaged_lost']['restore_s'][-1] * 1e3:.0f} ms, lost into a spare "
                  f"{out['prestaged_spare']['restore_s'][-1] * 1e3:.0f} ms, pre-staged copied {out['prestaged_copied']['restore_s'][-1] * 1e3:.0f} ms | docker "
                  f"frozen {dk['frozen_s'] * 1e3:.0f} ms, restore {out['docker']['restore_s'][-1] * 1e3:.0f} ms",
                  flush=True)
    finally:
        env.close()
        fence(client, sb.name, background=False)
        for c in client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"}):
            fence(client, c["Names"][0].lstrip("/"), background=False)
        for image in images:  # removal is slow under load: after the timed part
            try:
                client.api.remove_image(image, force=True)
            except Exception as e:  # noqa: BLE001 - best effort cleanup
                print(f"  (could not remove {image[:19]}: {e})")
    return out


def summarize(samples: list[float]) -> dict:
    s = sorted(samples)
    pct = lambda q: s[min(len(s) - 1, round(q * (len(s) - 1)))]  # noqa: E731
    return {"p50": statistics.median(s), "p90": pct(0.90), "p95": pct(0.95), "min": s[0], "max": s[-1],
            "n": len(s)}


ROWS = (("belayer", "frozen_s", "frozen: incremental capture"), ("paused", "frozen_s", "frozen: paused capture"),
        ("docker", "frozen_s", "frozen: docker checkpoint"),
        ("env_standby", "recovery_s", "env rollback onto a standby"),
        ("standby", "restore_s", "rollback onto a standby (promote)"), ("prestaged_spare", "restore_s", "restore: lost, into a spare"),
        ("prestaged_lost", "restore_s", "restore: lost, pre-staged"), ("prestaged", "restore_s", "restore: pre-staged"),
        ("prestaged_copied", "restore_s", "restore: pre-staged, copied"), ("belayer", "restore_s", "restore: not pre-staged"),
        ("docker", "restore_s", "restore: docker start --checkpoint"), ("cold", "restore_s", "cold create + start"),
        ("fork_warm", "restore_s", "fork xN: restored ahead, frozen"),
        ("fork_ahead", "restore_s", "fork xN: pool, verified ahead"), ("fork_pooled", "restore_s", "fork xN: pool"),
        ("fork", "restore_s", "fork xN: shared layer"), ("fork_copied", "restore_s", "fork xN: a copy each"))
"""The plot's rows (method, metric, label), Belayer's paths first, each group above its baselines."""
TARGETS_MS = {("belayer", "frozen_s"): (20, "heavy"), ("standby", "restore_s"): (5, None),
              ("env_standby", "recovery_s"): (5, None),
              ("fork_warm", "restore_s"): (250, None), ("fork_ahead", "restore_s"): (250, None)}
"""Issue 35's targets (p50 ms, the one scenario they are set for or None for all), drawn on their rows."""


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def verdicts(result: dict) -> list[dict]:
    """Each target of ``TARGETS_MS`` against this run's p50, with the floor measured beside it
    (``_floors``) where one stops it."""
    out = []
    for (method, metric), (target, only) in TARGETS_MS.items():
        for scen, data in result["scenarios"].items():
            if only not in (None, scen) or metric not in data.get(method, {}):
                continue
            p50 = data[method][metric]["p50"] * 1e3
            floors = {k: v["p50"] * (1e3 if k.endswith("_s") else 1) for k, v in data.get("floors", {}).items()}
            row = {"method": method, "metric": metric, "scenario": scen, "target_ms": target,
                   "p50_ms": round(p50, 2), "met": p50 <= target}
            if method == "belayer":
                est = result.get("soft_dirty_estimate", {}).get(scen, {}).get("frozen_s_p50_estimate")
                row["floor_ms"] = {"bare CRIU dump, CRIU's own frozen time (FROZEN to thaw)": floors.get("criu_frozen_s"),
                                   "of it the memory dump (every page: no soft-dirty)": floors.get("criu_memdump_s"),
                                   "bare freezer freeze + thaw": floors.get("freeze_thaw_s")}
                row["with_soft_dirty_estimate_ms"] = None if est is None else round(est * 1e3, 1)
            elif method == "env_standby":
                row["parts_ms"] = {k: round(v["p50"] * 1e3, 3) for k, v in data[method].items() if k != "recovery_s"}
            elif method == "standby":
                row["phases_ms"] = {k: round(v["p50"] * 1e3, 3) for k, v in data.get("standby_phases", {}).items()
                                    if k.endswith("_s")}
                row["floor_ms"] = {"bare freezer freeze + thaw": floors.get("freeze_thaw_s"),
                                   "one fence listing through Docker (moved off)": floors.get("docker_list_s")}
            elif method.startswith("fork_"):
                row["floor_ms"] = {f"{result.get('fork_n')} containers started side by side through Docker, "
                                   "no checkpoint": floors.get("start_n_s")}
            out.append(row)
    return out


def plot(result: dict, path: Path) -> None:
    """One panel per scenario, one labelled bar per (method, figure): p50, whisker to p90,
    the issue's target as a red tick where one applies; Docker's own paths and the cold
    start in grey."""
    from _plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    scenarios = list(result["scenarios"])
    fig, axes = plt.subplots(1, len(scenarios), figsize=(7.5 * len(scenarios), 6.5), squeeze=False)
    for ax, scen in zip(axes[0], scenarios, strict=True):
        data = result["scenarios"][scen]
        rows = [(m, k, label) for m, k, label in ROWS if k in data.get(m, {})]
        for y, (method, metric, _) in enumerate(rows):
            p50, p90 = (data[method][metric][q] * 1e3 for q in ("p50", "p90"))
            grey = method in ("docker", "cold")
            ax.barh(y, p50, xerr=[[0], [max(p90 - p50, 0)]], capsize=2, height=0.7,
                    color="0.65" if grey else f"C{0 if metric == 'frozen_s' else 1}")
            ax.text(max(p50, p90) * 1.06, y, f"{p50:.0f}", va="center", fontsize=7)
            target, only = TARGETS_MS.get((method, metric), (None, None))
            if target is not None and only in (None, scen):
                ax.plot([target, target], [y - 0.45, y + 0.45], color="red", lw=1.5)
        ax.set_yticks(range(len(rows)), [label.replace("xN", f"x{result.get('fork_n', 'N')}") for *_, label in rows],
                      fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms (bar p50, whisker p90, log; red: target)")
        ax.set_title(f"{scen}: {result.get('runs', '?')} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--scenarios", default="idle,heavy")
    ap.add_argument("--fork-n", type=int, default=8, help="sandboxes per fork (0: no fork measurement)")
    ap.add_argument("--capture-only", action="store_true",
                    help="only the paused vs incremental captures (and a restore every other round)")
    ap.add_argument("--fork-only", action="store_true", help="only a capture and the three forks (shared, copied, pooled)")
    ap.add_argument("--restore-only", action="store_true",
                    help="only a capture and the three pre-staged restores (sandbox live, lost, lost into a spare)")
    ap.add_argument("--out", default=None, help="default: results/checkpoint_bench.json, the one current result "
                    "(a partial run, --capture-only, --fork-only or --restore-only: /tmp/checkpoint_bench_<part>.json)")
    args = ap.parse_args()
    if args.out is None:
        part = "capture" if args.capture_only else "fork" if args.fork_only else "restore" if args.restore_only else None
        args.out = (f"/tmp/checkpoint_bench_{part}.json" if part else
                    str(Path(__file__).parent / "results" / "checkpoint_bench.json"))
    client = connect()
    run_id = uuid.uuid4().hex[:8]
    store_dir = Path(tempfile.mkdtemp(prefix="belayer-bench-", dir="/var/tmp"))
    store = CheckpointStore(store_dir, keep=2)
    commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or None
    result = {"source": {"command": " ".join(["python3", "benchmarks/checkpoint_bench.py", *sys.argv[1:]]),
                         "commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()),
                         "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}"},
              "host": {"kernel": platform.release(), "cpus": os.cpu_count(),
                       "loadavg_start": os.getloadavg(), "uptime_start": uptime(), "docker": client.version()["Version"],
                       "criu": subprocess.run(["criu", "--version"], capture_output=True, text=True).stdout.split()[1],
                       "store": str(store_dir), "run_id": run_id, "owner": owner_tag(), "loadavg": []},
              "runs": args.runs, "fork_n": args.fork_n, "scenarios": {},
              "note": "the machine was shared with other agents' work: see host.loadavg (1/5/15-min, "
                      "after every run); figures under load are meaningful side by side, as ratios"}
    try:
        for scen in args.scenarios.split(","):
            if args.fork_only:
                raw = run_fork_only(client, scen, args.runs, store, run_id, args.fork_n, result["host"]["loadavg"])
            elif args.restore_only:
                raw = run_restore_only(client, scen, args.runs, store, run_id, result["host"]["loadavg"])
            elif args.capture_only:
                raw = run_capture_only(client, scen, args.runs, store, run_id, result["host"]["loadavg"])
            else:
                raw = run_scenario(client, scen, args.runs, store, run_id, args.fork_n, result["host"]["loadavg"])
            result["scenarios"][scen] = {m: {k: summarize(v) for k, v in d.items() if v} for m, d in raw.items()}
            result["scenarios"][scen]["raw"] = raw
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    result["host"]["loadavg_end"] = os.getloadavg()
    result["host"]["uptime_end"] = uptime()
    result["soft_dirty_estimate"] = _floors.soft_dirty_estimate(result["scenarios"])
    result["targets"] = verdicts(result)
    out = save_result(result, args.out, plot)
    for scen, data in result["scenarios"].items():
        print(f"\n{scen}:")
        for m in [m for m in METHODS if m in data]:
            cells = "  ".join(f"{k} p50 {v['p50'] * (1e3 if k != 'size_bytes' else 1e-6):7.1f}"
                              f"{'ms' if k != 'size_bytes' else 'MB'} p90 {v['p90'] * (1e3 if k != 'size_bytes' else 1e-6):7.1f}"
                              for k, v in data.get(m, {}).items())
            print(f"  {LABELS[m]:31} {cells}")
        for part in ("env_standby", "standby_phases", "floors"):
            if data.get(part):
                print(f"  {part} (p50): " + ", ".join(f"{k} {v['p50'] * (1e3 if k.endswith('_s') else 1):.2f}"
                                                     for k, v in data[part].items()))
        detail = data.get("belayer_detail", {})
        if detail:
            print("  incremental detail (p50): " + ", ".join(
                f"{k} {v['p50'] * (1e3 if k.endswith('_s') else 1):.1f}{'ms' if k.endswith('_s') else ''}"
                for k, v in detail.items()))
    for row in result.get("targets", []):
        print(f"target {row['method']} {row['metric']} {row['scenario']}: p50 {row['p50_ms']} ms vs "
              f"{row['target_ms']} ms: {'met' if row['met'] else 'NOT met'}; floor {row.get('floor_ms')}")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
