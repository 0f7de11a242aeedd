"""The floors under the checkpoint benchmarks' figures, measured in the same run on the same
sandbox (issue 35 item 4): what no Belayer change can go below on this kernel and host.

- ``freeze_thaw_s``: the bare freezer cgroup cycle (write FROZEN until frozen, write THAWED).
- ``criu_*``: a bare ``runc checkpoint --leave-running`` of the same process tree (CRIU
  freezes it itself; nothing of ours inside the freeze, no layer): CRIU's own frozen time
  from FROZEN to the thaw (``criu_frozen_s``, from its stats; its freezing apart,
  ``criu_freezing_s``: CRIU's freeze loop sleeps 100 ms when the first read says FREEZING,
  which Belayer's own freeze avoids), of it the memory dump (``criu_memdump_s``) and the
  pages written. Every CRIU-based capture's frozen window is at least ``criu_frozen_s``;
  this kernel has no soft-dirty tracking, so every page is dumped frozen.
- ``docker_list_s``: one fence listing through Docker (two list calls side by side), what a
  rollback paid per listing before its listing moved off the critical path;
  ``docker_ping_s``: one bare Docker API round trip.
- ``start_n_s``: n containers created ahead (untimed) started side by side through Docker,
  without a checkpoint: the floor of n forks that each go through Docker's start.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from belayer_env.criu import hooks as criu_hooks
from belayer_env.criu import runtime
from belayer_env.sandbox import freezer
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.create import create_container
from belayer_env.sandbox.fence import fence, sandbox_containers

SCRATCH = Path("/dev/shm")


def freeze_thaw(sb: DockerSandbox) -> float:
    t0 = time.perf_counter()
    assert freezer.freeze(sb.container_id, poll_s=0.0005), "bare freeze failed"
    assert freezer.thaw(sb.container_id), "bare thaw failed"
    return time.perf_counter() - t0


def bare_criu(sb: DockerSandbox) -> dict[str, float]:
    """A bare CRIU dump of ``sb``'s process tree (it keeps running) and CRIU's own statistics."""
    tmp = Path(tempfile.mkdtemp(prefix="belayer-bench-criu-", dir=SCRATCH if SCRATCH.is_dir() else None))
    try:
        t0 = time.perf_counter()
        runtime.dump(sb.container_id, tmp / "images", tmp / "work", isolated=not sb.config.network,
                     ghost_limit=sb.config.memory_bytes)
        wall = time.perf_counter() - t0
        st = criu_hooks.dump_stats(tmp / "work")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"criu_wall_s": wall, "criu_frozen_s": st.get("frozen_time", 0) / 1e6,
            "criu_freezing_s": st.get("freezing_time", 0) / 1e6, "criu_memdump_s": st.get("memdump_time", 0) / 1e6, "criu_pages_written": float(st.get("pages_written", 0))}


def docker_round_trips(client, sb: DockerSandbox) -> dict[str, float]:
    t0 = time.perf_counter()
    client.api.ping()
    t1 = time.perf_counter()
    sandbox_containers(client, sb.name, by_name=True)
    return {"docker_ping_s": t1 - t0, "docker_list_s": time.perf_counter() - t1}


def start_n(client, sb: DockerSandbox, n: int) -> float:
    """n containers like ``sb``'s, created ahead, then started side by side (timed)."""
    names = [f"{sb.name}-floor{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
    made = [create_container(client, sb.config, name) for name in names]
    try:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(lambda c: c.start(), made))
        return time.perf_counter() - t0
    finally:
        for name in names:
            fence(client, name, background=False)


def record(out: dict[str, list[float]], figures: dict[str, float]) -> None:
    """Append one round's floors to ``out``, one list per figure (each benchmark measures the
    floors under its own figures: ``freeze_thaw`` and ``bare_criu`` under a capture's frozen
    time, ``freeze_thaw`` and ``docker_round_trips`` under a standby's promotion, ``start_n``
    under n forks)."""
    for k, v in figures.items():
        out.setdefault(k, []).append(v)


def soft_dirty_estimate(scenarios: dict) -> dict:
    """What a kernel with CONFIG_MEM_SOFT_DIRTY would give, estimated from this run's pieces
    (an estimate, not a measurement): CRIU's pre-dump copies memory while the sandbox runs,
    so the frozen dump writes only the pages dirtied since. Frozen time = the capture's
    measured frozen window minus its own memory dump (``belayer_detail``), plus the idle
    sandbox's whole memory dump (more than one agent step dirties in a heavy one)."""
    def memdump(data: dict) -> float | None:
        own = data.get("belayer_detail", {}).get("criu_memdump_s", {}).get("p50")
        return own if own is not None else data.get("floors", {}).get("criu_memdump_s", {}).get("p50")

    idle = memdump(scenarios.get("idle", {}))
    out = {}
    for name, data in scenarios.items():
        frozen = data.get("belayer", {}).get("frozen_s", {}).get("p50")
        dumped = memdump(data)
        if frozen is None or dumped is None:
            continue
        dirty = min(idle if idle is not None else 0.0, dumped)
        out[name] = {"frozen_s_p50_estimate": max(frozen - dumped + dirty, 0.0),
                     "memdump_s_p50_now": dumped, "dirty_memdump_s_assumed": dirty}
    return out
