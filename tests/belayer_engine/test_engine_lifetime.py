"""Arena, workers and shadows never outlive their engine (issue 12), with real processes.

A clean stop removes the arena's /dev/shm files; an engine killed by SIGKILL or SIGTERM
(no cleanup of its own) takes its children with it (death signal + owner watchdog); a
child that cannot react (stopped) is found and ended by ``belayer gc``, with its files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from belayer_engine import RecoverableEngine
from belayer_engine.arena.shm_files import SHM_DIR, SHM_PREFIX
from belayer_engine.supervisor import run_dir as run_dirs

from .conftest import REPO, poll

pytestmark = pytest.mark.timeout(600)

ENGINE_SCRIPT = """
import json, sys, time
from belayer_engine import RecoverableEngine
with RecoverableEngine.launch(workers=1, shadow=True) as eng:
    eng.wait_ready(timeout=180)
    s = eng.status()["slots"]["w0"]
    print(json.dumps({"arena": s["arena_pid"], "worker": s["worker_pid"], "shadow": s["shadow_pid"],
                      "run_dir": str(eng.supervisor.run_dir)}), flush=True)
    sys.stdin.readline()  # the test has looked at the children
    if sys.argv[1] == "raise":
        raise RuntimeError("the owner's code failed")
    time.sleep(3600)
"""


def shm_files(pid: int) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{SHM_PREFIX}{pid}-*"))


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_engine_process(mode: str) -> tuple[subprocess.Popen, dict, Path]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, mode], cwd=REPO, env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    assert line, f"engine script ended early (exit {p.wait()})"
    pids = json.loads(line)
    return p, pids, Path(pids.pop("run_dir"))


def test_a_clean_stop_removes_the_arena_files():
    with RecoverableEngine.launch(workers=1, shadow=False) as eng:
        arena = eng.status()["slots"]["w0"]["arena_pid"]
        files = shm_files(arena)
        assert files, "the arena has shared-memory files while it runs"
    assert not alive(arena)
    assert not any(f.exists() for f in files)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "raise"])
def test_children_end_with_their_engine(how):
    p, pids, run_dir = start_engine_process(how)
    try:
        files = shm_files(pids["arena"])
        assert files and all(alive(pid) for pid in pids.values())
        assert run_dir not in run_dirs.orphaned()  # its engine runs
        if how == "raise":
            p.stdin.write("go\n")
            p.stdin.flush()
        else:
            os.kill(p.pid, getattr(signal, how))
        p.wait(timeout=60)
        for role, pid in pids.items():
            poll(lambda pid=pid: not alive(pid), 30, f"the {role} (pid {pid}) to end after its engine ({how})")
        poll(lambda: not any(f.exists() for f in files), 30, "the arena's shm files to be removed")
        if how == "raise":  # the engine's own clean-up ran
            assert not run_dir.exists()
        else:  # no clean-up of its own: its run dir is an orphan for belayer gc
            assert run_dir.exists() and run_dir in run_dirs.orphaned()
            assert str(run_dir) in run_dirs.reap_orphans() and not run_dir.exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_gc_ends_a_child_that_could_not_react(tmp_path):
    """A stopped arena cannot act on its owner's death: ``belayer gc`` ends it and removes its files."""
    p, pids, run_dir = start_engine_process("SIGKILL")
    try:
        arena = pids["arena"]
        files = shm_files(arena)
        os.kill(arena, signal.SIGSTOP)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
        for role in ("worker", "shadow"):
            poll(lambda role=role: not alive(pids[role]), 30, f"the {role} to end")
        assert alive(arena) and all(f.exists() for f in files)  # stopped: still there
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        dry = subprocess.run([sys.executable, "-m", "belayer", "gc", "--dry-run", "--json"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
        assert dry.returncode == 0, dry.stderr
        assert arena in [e["pid"] for e in json.loads(dry.stdout)["engine_processes"]] and alive(arena)
        assert str(run_dir) in json.loads(dry.stdout)["engine_run_dirs"] and run_dir.exists()
        out = subprocess.run([sys.executable, "-m", "belayer", "gc", "--json"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout)
        assert next(e for e in summary["engine_processes"] if e["pid"] == arena)["ended"]
        assert not alive(arena)
        assert not any(f.exists() for f in files)
        assert str(run_dir) in summary["engine_run_dirs"] and not run_dir.exists()
    finally:
        with_pids = [p.pid, *pids.values()]
        for pid in with_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
