"""The relay CRIU calls inside its freeze (``criu_hooks.HookRelay``), run as CRIU runs it: an
exec at each stage with the stage in ``CRTOOLS_SCRIPT_ACTION``, of the static hook set-up
builds (``native``: the relay named in its environment) or of the dump's own shell script.

What matters: a stage that waits for the checkpointer's answer reads exactly that answer,
also when it arrives in parts (a misread "k" once failed a dump in a loaded test run), fails
the dump when the answer is "fail", and gives up as soon as the checkpointer is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from belayer_env.criu.hooks import HookRelay
from belayer_env.host.native import NATIVE, BuildError, compile_static

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def static_hook(tmp_path_factory) -> Path:
    hook = tmp_path_factory.mktemp("hook") / "belayer-criu-loopback"
    try:
        compile_static(hook, [NATIVE / "criu_loopback.c"])
    except BuildError as e:
        pytest.skip(f"no static hook here: {e}")
    return hook


@pytest.fixture(params=["native", "script"])
def mode(request) -> str:
    return request.param


def stage_argv(relay: HookRelay, hook: Path | None) -> tuple[list[str], dict[str, str]]:
    """What CRIU execs for the relay, and the environment it gets."""
    if relay.env:
        assert not relay.config_lines and hook is not None
        return [str(hook)], {**os.environ, **relay.env}
    assert relay.config_lines[0].startswith("action-script ")
    return [relay.config_lines[0].removeprefix("action-script ")], dict(os.environ)


def run_stage(relay: HookRelay, hook: Path | None, stage: str) -> subprocess.CompletedProcess:
    argv, env = stage_argv(relay, hook)
    return subprocess.run(argv, env={**env, "CRTOOLS_SCRIPT_ACTION": stage}, capture_output=True, text=True,
                          timeout=60)


class _Hooks:
    """No-op hooks; ``before_resume`` writes the answer in two parts, 0.2 s apart, before the
    relay's own answer."""

    def __init__(self, answer_fifo: Path):
        self.answer_fifo = answer_fifo

    def freeze(self) -> None:
        pass

    def frozen(self) -> None:
        pass

    def before_resume(self) -> None:
        fd = os.open(self.answer_fifo, os.O_WRONLY)
        try:
            os.write(fd, b"o")
            time.sleep(0.2)  # the fault: a pause between two bytes of the answer
            os.write(fd, b"k\n")
        finally:
            os.close(fd)

    def resuming(self) -> None:
        pass


def _relay(tmp_path: Path, hooks, mode: str) -> HookRelay:
    return HookRelay(tmp_path, hooks, timeout_s=10, native=mode == "native")


def test_every_stage_is_relayed_in_order(tmp_path, mode, static_hook):
    class Plain(_Hooks):
        def before_resume(self) -> None:
            pass

    relay = _relay(tmp_path, Plain(tmp_path / "criu-answer"), mode)
    try:
        for stage in ("pre-dump", "network-lock", "post-dump", "network-unlock", "post-restore"):
            p = run_stage(relay, static_hook, stage)
            assert p.returncode == 0, (stage, p.stderr)
    finally:
        relay.close()
    assert list(relay.times) == ["freeze", "frozen", "dumped", "answered", "resuming"]
    assert relay.error is None


def test_post_dump_reads_an_answer_that_arrives_in_parts(tmp_path, mode, static_hook):
    relay = _relay(tmp_path, _Hooks(tmp_path / "criu-answer"), mode)
    try:
        p = run_stage(relay, static_hook, "post-dump")
    finally:
        relay.close()
    assert p.returncode == 0, f"the stage misread a split 'ok' answer: {p.returncode} {p.stderr}"
    assert "answered" in relay.times and relay.error is None


def test_post_dump_fails_when_the_checkpointer_says_fail(tmp_path, mode, static_hook):
    class Failing(_Hooks):
        def before_resume(self) -> None:
            raise RuntimeError("layer too large")

    relay = _relay(tmp_path, Failing(tmp_path / "criu-answer"), mode)
    try:
        p = run_stage(relay, static_hook, "post-dump")
    finally:
        relay.close()
    assert p.returncode != 0 and isinstance(relay.error, RuntimeError)


_CHECKPOINTER = """
import json, sys, threading
from pathlib import Path
from belayer_env.criu.hooks import HookRelay
class Stuck:  # never answers post-dump: the process dies first
    def freeze(self): pass
    def frozen(self): pass
    def before_resume(self): threading.Event().wait()
    def resuming(self): pass
relay = HookRelay(Path(sys.argv[1]), Stuck(), timeout_s=600, native=sys.argv[2] == "native")
print(json.dumps([relay.env, relay.config_lines]), flush=True)
threading.Event().wait()
"""


def test_a_waiting_stage_fails_once_the_checkpointer_is_gone(tmp_path, mode, static_hook):
    """No timeout to wait out (the dump timeout here is 600 s): the checkpointer's SIGKILL
    closes the answer FIFO's last writer, and the waiting read sees EOF."""
    checkpointer = subprocess.Popen([sys.executable, "-c", _CHECKPOINTER, str(tmp_path), mode], stdout=subprocess.PIPE,
                                    text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        env, lines = json.loads(checkpointer.stdout.readline())
        argv = [str(static_hook)] if env else [lines[0].removeprefix("action-script ")]
        stage = subprocess.Popen(argv, env={**os.environ, **env, "CRTOOLS_SCRIPT_ACTION": "post-dump"},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        checkpointer.send_signal(signal.SIGKILL)
        checkpointer.wait()
        _, err = stage.communicate(timeout=60)
    finally:
        checkpointer.kill()
        checkpointer.wait()
    assert stage.returncode == 1, f"the stage did not fail with its checkpointer gone: {stage.returncode} {err}"
