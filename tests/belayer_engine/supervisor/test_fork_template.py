"""Shadows cloned from the supervisor's worker template (``ForkTemplate``), real processes.

A clone is this process's child in its own session, like a spawned worker: the handover
onto it continues responses token-identically, its kill is seen, fenced and reaped here,
and nothing of it (or of the template) outlives the engine.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from belayer_engine.engine import RecoverableEngine
from belayer_engine.supervisor.fork_template import ForkTemplate, template_supported
from belayer_engine.supervisor.processes import fence
from tests.belayer_engine.conftest import poll
from tests.belayer_engine.test_chaos import PROMPTS, fault_free, run_round
from tests.conftest import process_alive

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not template_supported(), reason="clones need Linux x86_64/aarch64 and pidfds")]


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _pgid(pid: int) -> int:
    return os.getpgid(pid)


def test_shadows_are_clones_and_handovers_stay_token_identical():
    with RecoverableEngine.launch(workers=1, shadow=True) as eng:
        eng.wait_ready(timeout=180)
        base = fault_free(eng.base_url)
        template = poll(lambda: next((e["pid"] for e in eng.events() if e["event"] == "template_ready"), None),
                        120, "the worker template")
        seen: list[int] = []
        for _ in range(2):  # the first kill re-arms a clone; the second hands over onto that clone
            worker = eng.worker_pid(0)
            seen.append(worker)
            results = asyncio.run(run_round(eng.base_url, PROMPTS, 3, lambda w=worker: os.kill(w, signal.SIGKILL)))
            assert [ids for ids, _, _ in results] == [base[p] for p in PROMPTS]
            eng.wait_ready(timeout=120, stable=True)
        events = eng.events()
        cloned = [e for e in events if e["event"] == "shadow_ready" and e.get("cloned")]
        assert len(cloned) >= 2, events
        assert eng.worker_pid(0) == cloned[-2]["pid"]  # serving: a clone, promoted at the second kill
        shadow = eng.status()["slots"]["w0"]["shadow_pid"]
        for pid in (eng.worker_pid(0), shadow):
            assert _ppid(pid) == os.getpid() and _pgid(pid) == pid  # our child, in its own session
        assert not any(process_alive(p) for p in seen)  # the killed ones were reaped here
        clones = [eng.worker_pid(0), shadow]
    for pid in [*clones, template]:
        poll(lambda pid=pid: not process_alive(pid), 30, f"pid {pid} to end with its engine")


def test_a_clone_runs_main_with_its_log_env_and_session(tmp_path):
    """The template clones only its own module; the clone gets its own log, environment and
    session, runs ``main(args)``, and its exit status is reaped here."""
    async def scenario() -> None:
        template = ForkTemplate(os.sys.executable, "tests.belayer_engine.supervisor.template_target",
                                {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
                                tmp_path / "template.log")
        await template.start(120)
        try:
            argv = [os.sys.executable, "-m", template.module, "hello", "3"]
            proc = await template.spawn("worker", "w", argv, tmp_path / "w.log", env={"ONLY": "this"})
            # it may have exited (and been reaped) already: its status reaching us via waitpid
            # is what says it is our child here (a stranger's would read 255); the sleeper's
            # parent is checked below, while it lives
            assert proc.cloned and await asyncio.wait_for(proc.process.wait(), 30) == 3
            assert not process_alive(proc.pid)
            out = (tmp_path / "w.log").read_text().split()
            assert out[:3] == ["hello", "this", "True"]  # args, env, own session
            with pytest.raises(Exception, match="runs"):
                await template.spawn("worker", "x", [os.sys.executable, "-m", "json.tool"], tmp_path / "x.log")
            sleeper = await template.spawn("worker", "s", [*argv[:3], "sleep", "0"], tmp_path / "s.log", env={})
            assert _ppid(sleeper.pid) == os.getpid() and _pgid(sleeper.pid) == sleeper.pid
            await fence(sleeper, 10)  # SIGKILL to its group, reaped here
            assert sleeper.process.returncode == -signal.SIGKILL and not process_alive(sleeper.pid)
        finally:
            await template.stop()
        assert not template.alive

    asyncio.run(scenario())
