"""What does a fork cost: N running sandboxes from one checkpoint, every way Belayer makes them?

Each round captures the sandbox (untimed: ``capture_bench.py``; ``_checkpoint_common``:
scenarios ``idle`` and ``heavy``, an agent-like step first), then forks it
``--fork-n`` times (default 8) every way, the order rotating by round; ``restore_s`` is
the time until all n run:

- ``fork``: ``fork(checkpoint, n)``: n sandboxes side by side, sharing its layer as a
  read-only overlay lower layer (unpacked once).
- ``fork_copied``: ``fork(checkpoint, n, share=False)``: each fork unpacking its own copy of
  the layer (what ``fork`` did before).
- ``fork_pooled``: ``fork(checkpoint, n, pool=pool)`` into a ``ForkPool`` of n containers
  created ahead from the sandbox (untimed, as an env's ``fork_pool`` fills in the
  background): the forks only start.
- ``fork_ahead``: the same, the pool having also verified the checkpoint's shared layer and
  runtime images ahead (``ForkPool.prepare``, as ``EnvConfig(fork_pool=n)`` does when a
  checkpoint is published; ``prepare_s``, untimed in use): the call only starts containers.
- ``fork_warm``: ``warm_forks(checkpoint, n)``: the n forks restored ahead and frozen
  (``prepare_s``, untimed in use), then ``fork(checkpoint, n, warm=...)``: n thaws and checks
  (``thaw_s``, ``verify_s``).
- ``floors`` (``_floors.py``): n plain containers, created ahead, started side by side
  through Docker. The JSON's ``targets`` holds issue 35's targets against this run's p50
  with that floor beside them.

Run: ``python3 benchmarks/fork_bench.py --runs 5 --fork-n 8`` (needs Docker + CRIU, root).
Writes ``benchmarks/results/fork_bench.json`` (+ ``.png`` with matplotlib).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_env.capture.checkpoint import full_checkpoint  # noqa: E402
from belayer_env.forks.fork import fork, warm_forks  # noqa: E402
from belayer_env.forks.pool import ForkPool  # noqa: E402
from belayer_env.ops.gc import sweep_shared_layers  # noqa: E402
from belayer_env.sandbox.container import DockerSandbox  # noqa: E402
from belayer_env.sandbox.fence import fence  # noqa: E402
from belayer_env.store.manifest import read_manifest_digest  # noqa: E402
from benchmarks import _checkpoint_common as common  # noqa: E402
from benchmarks import _floors  # noqa: E402

FORK_METHODS = ("fork", "fork_copied", "fork_pooled", "fork_ahead", "fork_warm")


def fork_all(client, ck, n: int, share: bool = True, pool: ForkPool | None = None) -> float:
    waiting = set(pool.container_ids()) if pool is not None else set()
    common.settle()
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
            common.settle()
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
    common.settle()
    t0 = time.monotonic()
    warm = warm_forks(ck, n, client=client)
    try:
        assert warm.done.wait(common.WAIT_S) and warm.ready(), f"warm forks not prepared: {warm.error}"
        out["prepare_s"].append(time.monotonic() - t0)
        common.settle()
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


def fork_round(client, sb: DockerSandbox, ck, n: int, i: int, out: dict) -> None:
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


def measure(run: common.Run) -> dict:
    client, n = run.client, run.args.fork_n
    sb = common.bench_sandbox(client, run.scenario, run.run_id)
    out = {"fork": {"restore_s": []}, "fork_copied": {"restore_s": []}, "fork_pooled": {"restore_s": []},
           "fork_ahead": {"restore_s": [], "prepare_s": []}, "belayer": {"size_bytes": []},
           "fork_warm": {"restore_s": [], "prepare_s": [], "thaw_s": [], "verify_s": []}, "floors": {}}
    try:
        for i in range(run.runs):
            sb.execute(common.STEP.format(i=i))
            ck = full_checkpoint(sb, run.store)
            out["belayer"]["size_bytes"].append(ck.size_bytes)
            common.settle()
            _floors.record(out["floors"], {"start_n_s": _floors.start_n(client, sb, n)})
            fork_round(client, sb, ck, n, i, out)
            load = run.round_done()
            ms = {m: out[m]["restore_s"][-1] * 1e3 for m in FORK_METHODS}
            print(f"  {run.scenario} run {i + 1}/{run.runs}: fork x{n} shared {ms['fork']:.0f} ms, copied "
                  f"{ms['fork_copied']:.0f} ms, pooled {ms['fork_pooled']:.0f} ms, pooled + prepared ahead "
                  f"{ms['fork_ahead']:.0f} ms, warm {ms['fork_warm']:.1f} ms, load {load:.1f}", flush=True)
    finally:
        common.fence_run(client, run.run_id)
        sweep_shared_layers(client)
    return out


def add_args(ap) -> None:
    def at_least_one(text: str) -> int:
        if int(text) < 1:
            raise ValueError(text)
        return int(text)

    ap.add_argument("--fork-n", type=at_least_one, default=8, help="sandboxes per fork (>= 1)")


QUESTION = common.Question(
    name="fork_bench", doc=__doc__, measure=measure, add_args=add_args, result_args=("fork_n",),
    labels={"fork": "belayer fork x N (all, shared)", "fork_copied": "belayer fork x N (all, copied)",
            "fork_pooled": "belayer fork x N (all, shared, into a pool created ahead)",
            "fork_ahead": "belayer fork x N (into a pool, its layer and images verified ahead)",
            "fork_warm": "belayer fork x N (restored ahead and frozen: a thaw each)",
            "belayer": "the checkpoint forked"},
    rows=(("fork_warm", "restore_s", "fork xN: restored ahead, frozen"),
          ("fork_ahead", "restore_s", "fork xN: pool, verified ahead"), ("fork_pooled", "restore_s", "fork xN: pool"),
          ("fork", "restore_s", "fork xN: shared layer"), ("fork_copied", "restore_s", "fork xN: a copy each"),
          ("floors", "start_n_s", "floor: N plain containers started")),
    targets_ms={("fork_warm", "restore_s"): (250, None), ("fork_ahead", "restore_s"): (250, None)},
    parts=("floors",))


if __name__ == "__main__":
    sys.exit(common.main(QUESTION))
