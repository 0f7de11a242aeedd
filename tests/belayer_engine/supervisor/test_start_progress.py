"""A slow start says where it is (issue 35 item 5): the supervisor's wait for a child logs
its progress with the child's newest log line, then succeeds once the child is ready. Real
child processes; the test makes the child ready only after the first progress line."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from belayer_core.errors import WorkerLost
from belayer_engine.supervisor.config import SupervisorConfig
from belayer_engine.supervisor.processes import fence, spawn, wait_until

CHILD = "import time; print('compiling kernels', flush=True); time.sleep(600)"


def test_a_slow_start_logs_progress_then_succeeds(tmp_path):
    ready_file = tmp_path / "ready"

    async def main() -> list[str]:
        proc = await spawn("worker", "w-slow", [sys.executable, "-c", CHILD], tmp_path / "w.log")
        seen: list[str] = []

        class Watch(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                seen.append(record.getMessage())
                if "compiling kernels" in seen[-1]:  # ready only once progress showed the child's own line
                    ready_file.touch()

        handler = Watch()
        logging.getLogger("belayer_engine.start").addHandler(handler)
        try:
            async def ready() -> bool:
                return ready_file.exists()

            await wait_until(ready, proc, timeout=120, what="ready", interval=0.01, progress_every=0.05)
        finally:
            logging.getLogger("belayer_engine.start").removeHandler(handler)
            await fence(proc, 10)
        return seen

    seen = asyncio.run(main())
    assert seen and all("w-slow not ready yet" in line for line in seen)
    assert "compiling kernels" in seen[-1]


def test_a_start_that_never_comes_fails_with_the_log_tail(tmp_path):
    async def main() -> None:
        proc = await spawn("worker", "w-stuck", [sys.executable, "-c", CHILD], tmp_path / "w.log")
        try:
            async def never() -> bool:
                return False

            await wait_until(never, proc, timeout=0.3, what="ready", interval=0.01, progress_every=0.1)
        finally:
            await fence(proc, 10)

    with pytest.raises(WorkerLost, match="w-stuck not ready after 0s"):
        asyncio.run(main())


def test_the_default_start_timeout_fits_a_first_gpu_start_with_margin():
    assert SupervisorConfig().start_timeout_s >= 3 * 147  # the slowest first start measured (H200, SGLang)
