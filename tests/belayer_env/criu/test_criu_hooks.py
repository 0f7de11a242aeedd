"""The action script CRIU runs inside its freeze (``criu_hooks.HookRelay``), run as CRIU runs it.

What matters: the stage that waits for the checkpointer's answer reads exactly that
answer, also when a read timeout falls between its bytes (bash reads a FIFO byte by byte;
under load the script can be descheduled between two of them): a misread "k" failed a
dump in a loaded test run.
"""

from __future__ import annotations

import os
import subprocess
import time

from belayer_env.criu.hooks import HookRelay


class _SplitAnswer:
    """Hooks whose ``before_resume`` writes the answer in two parts, 0.2 s apart (the
    waiter's read timeout is 0.05 s), before the relay's own answer."""

    def __init__(self, answer_fifo: str):
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


def _run_stage(relay: HookRelay, stage: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", str(relay.script)], env={**os.environ, "CRTOOLS_SCRIPT_ACTION": stage},
                          capture_output=True, text=True, timeout=30)


def test_post_dump_reads_an_answer_split_by_a_read_timeout(tmp_path):
    hooks = _SplitAnswer(str(tmp_path / "criu-answer"))
    relay = HookRelay(tmp_path, hooks, timeout_s=10)
    try:
        p = _run_stage(relay, "post-dump")
    finally:
        relay.close()
    assert p.returncode == 0, f"the waiter misread a split 'ok' answer: {p.returncode} {p.stderr}"
    assert "answered" in relay.times and relay.error is None


def test_post_dump_fails_when_the_checkpointer_says_fail(tmp_path):
    class Failing(_SplitAnswer):
        def before_resume(self) -> None:
            raise RuntimeError("layer too large")

    relay = HookRelay(tmp_path, Failing(str(tmp_path / "criu-answer")), timeout_s=10)
    try:
        p = _run_stage(relay, "post-dump")
    finally:
        relay.close()
    assert p.returncode != 0 and isinstance(relay.error, RuntimeError)
