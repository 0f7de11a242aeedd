"""The frozen part of a capture: the sandbox's processes stopped while CRIU dumps them and
the layer is copied, from one instant (``full_checkpoint`` calls one of the two).

- ``frozen_incremental``: runc's and CRIU's start-up run while the sandbox runs; we freeze
  the cgroup when CRIU is about to seize it (``_InFreeze.freeze``, fast; CRIU's own freeze
  polls in 100 ms steps), copy the layer delta inside that window (``delta.Delta``) and thaw
  as soon as CRIU lets go (action scripts, ``criu/hooks.py``).
- ``frozen_paused``: Docker pauses the container, CRIU dumps it and tar copies the whole
  upperdir side by side, Docker unpauses it.

Each returns the seconds the sandbox was frozen; the sandbox runs again even on failure.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from belayer_core.errors import CheckpointFailed
from belayer_env.capture.delta import Delta
from belayer_env.common.phases import Phase, PhaseHook
from belayer_env.criu import runtime
from belayer_env.criu.hooks import dump_stats
from belayer_env.sandbox import freezer
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.protocol import Sandbox
from belayer_env.store import layer


def frozen_paused(sandbox: Sandbox, info: dict[str, Any], upper: Path, scratch: Path, with_runtime: bool,
                 hook: PhaseHook, abort: threading.Event | None = None, max_layer: int | None = None) -> float:
    """Pause, dump + tar the layer side by side, unpause; return the seconds spent frozen."""
    api, cid = sandbox.client.api, sandbox.container_id
    with translate_errors(f"pause sandbox {sandbox.name}"):
        if not info["State"].get("Paused"):  # paused already: a checkpointer died mid-freeze
            api.pause(cid)
    t = time.monotonic()
    tar = None
    try:
        hook(Phase.FROZEN)
        tar = layer.Capture(upper, scratch / "layer.tar", max_layer)
        if with_runtime:
            runtime.dump(cid, scratch / "runtime", scratch / "work", isolated=not sandbox.config.network,
                         abort=abort, boosted=False, ghost_limit=sandbox.config.memory_bytes)
            hook(Phase.RUNTIME_DUMPED)
        try:
            tar.wait()
        except layer.LayerChanged:
            # CRIU's dump mkdtemp()s under the container's /tmp (copy-up, then rmdir): a
            # tar racing it sees the tree move. The dump is over now: tar again, still frozen.
            tar = layer.Capture(upper, scratch / "layer.tar", max_layer)
            tar.wait()
        hook(Phase.LAYER_CAPTURED)
    finally:
        if tar is not None:
            tar.abort()
        if with_runtime and not freezer.is_frozen(cid):
            # a CRIU killed after seizing left the cgroup thawed (it re-freezes only at its
            # end) while Docker still holds it paused: freeze it so that the unpause works
            freezer.freeze(cid)
        with translate_errors(f"unpause sandbox {sandbox.name}"):
            api.unpause(cid)
    return time.monotonic() - t


FREEZE_POLL_S = 0.0005
"""How often the freezer state is polled while freezing and while waiting for CRIU to let go."""


class _InFreeze:
    """The freeze hooks of an incremental capture: freeze the cgroup when CRIU is about to
    (fast), start the layer delta once frozen, wait for it (and call the phase hooks)
    before the processes resume, and thaw as soon as CRIU has let them go (it re-freezes
    the cgroup it found frozen). ``paused``: Docker holds the container paused; leave the
    freezer to Docker."""

    def __init__(self, cid: str, init_pid: int, delta: Delta, hook: PhaseHook, with_runtime: bool,
                 paused: bool):
        self.cid, self.init_pid, self.paused = cid, init_pid, paused
        self.delta, self.hook, self.with_runtime = delta, hook, with_runtime
        self.t_freeze: float | None = None
        self.t_thawed: float | None = None

    def freeze(self) -> None:
        self.t_freeze = time.monotonic()
        if not self.paused and not freezer.freeze(self.cid, poll_s=FREEZE_POLL_S):
            raise CheckpointFailed(f"the freezer cgroup of {self.cid[:12]} did not freeze")

    def frozen(self) -> None:
        if self.t_freeze is None:
            self.t_freeze = time.monotonic()
        self.hook(Phase.FROZEN)
        self.delta.start()

    def before_resume(self) -> None:
        if self.with_runtime:
            self.hook(Phase.RUNTIME_DUMPED)
        self.delta.wait()
        self.hook(Phase.LAYER_CAPTURED)

    def resuming(self) -> None:
        if self.paused:
            return
        deadline = time.monotonic() + freezer.THAW_WAIT_S
        while _tracer(self.init_pid) not in (0, None) and time.monotonic() < deadline:
            time.sleep(FREEZE_POLL_S)  # CRIU re-freezes the cgroup, then detaches: thaw after that
        self.thaw()

    def thaw(self) -> None:
        if not self.paused and self.t_thawed is None and freezer.is_frozen(self.cid):
            freezer.thaw(self.cid)
            self.t_thawed = time.monotonic()


def _tracer(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def frozen_incremental(sandbox: Sandbox, info: dict[str, Any], scratch: Path, delta: Delta,
                        with_runtime: bool, hook: PhaseHook,
                        abort: threading.Event | None) -> tuple[float, dict[str, float]]:
    """CRIU dumps the container frozen by us right before CRIU's own freeze; the layer
    delta is copied inside that window; thawed as soon as CRIU lets go. Without runtime:
    Docker's pause around the delta copy. Returns the seconds frozen and where they went."""
    api, cid = sandbox.client.api, sandbox.container_id
    paused = bool(info["State"].get("Paused"))  # a checkpointer died mid-freeze (paused mode)
    hooks = _InFreeze(cid, int(info["State"].get("Pid") or 0), delta, hook, with_runtime, paused)
    if not with_runtime:
        with translate_errors(f"pause sandbox {sandbox.name}"):
            if not paused:
                api.pause(cid)
        t = time.monotonic()
        try:
            hooks.frozen()
            hooks.before_resume()
        finally:
            with translate_errors(f"unpause sandbox {sandbox.name}"):
                api.unpause(cid)
        return time.monotonic() - t, {}
    t = time.monotonic()
    try:
        control = freezer.control_file(cid)
        thaw_with = (control, "THAWED" if control.name == "freezer.state" else "0") if control and not paused else None
        runtime.dump(cid, scratch / "runtime", scratch / "work", isolated=not sandbox.config.network,
                     abort=abort, hooks=hooks, orphan_thaw=thaw_with, ghost_limit=sandbox.config.memory_bytes)
    finally:
        if paused:  # CRIU found it frozen and left it so
            if not freezer.is_frozen(cid):
                freezer.freeze(cid)
            with translate_errors(f"unpause sandbox {sandbox.name}"):
                api.unpause(cid)
        else:  # no network-unlock script ran (no network namespace), or the dump failed
            hooks.thaw()
    end = time.monotonic()
    st = dump_stats(scratch / "work")
    detail = {"runc_s": end - t, "before_freeze_s": (hooks.t_freeze or end) - t,
              "delta_scan_entries": len(delta.scan), "delta_copied": len(delta.changed),
              "criu_frozen_s": st.get("frozen_time", 0) / 1e6, "criu_freezing_s": st.get("freezing_time", 0) / 1e6,
              "criu_memdump_s": st.get("memdump_time", 0) / 1e6, "criu_pages_written": st.get("pages_written", 0)}
    if paused or hooks.t_freeze is None:
        return (st.get("freezing_time", 0) + st.get("frozen_time", 0)) / 1e6 or end - t, detail
    return (hooks.t_thawed or end) - hooks.t_freeze, detail
