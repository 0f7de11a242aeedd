"""Workers cloned from a process that already imported them, instead of a fresh interpreter.

A backend may name a worker program that a ``ForkTemplate`` keeps imported: a new worker
is then a clone of that template instead of a fresh interpreter importing torch again
(about 2 s of CPU on a quiet 2-core machine, more beside other work: the CPU demo re-arms
a shadow after each of its 20-30 worker kills). The kernel makes the clone a child of
this process (``CLONE_PARENT``), in its own session, so it is waited for, fenced and
reaped exactly like a spawned one (``processes.fence``); the template itself runs no
worker code.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import json
import os
import platform
import signal
import sys
import traceback
from pathlib import Path

from belayer_core.errors import WorkerLost
from belayer_engine.supervisor.processes import Proc

_CLONE_PARENT = 0x00008000
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}
TEMPLATE_ARG = "--fork-template"


def template_supported() -> bool:
    return sys.platform == "linux" and platform.machine() in _SYS_CLONE and hasattr(os, "pidfd_open")


class ClonedProcess:
    """What the supervisor uses of ``asyncio.subprocess.Process``, for a child that a
    ``ForkTemplate`` cloned: the kernel made it a child of this process, so it is reaped
    here (``waitpid``) once its pidfd says it exited. Created on the supervisor's loop."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._fd = os.pidfd_open(pid)  # our unreaped child: its pid cannot be reused meanwhile
        self._loop.add_reader(self._fd, self._reap)
        self._reap()

    def _reap(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere (never by this code): gone, status unknown
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return
        self.returncode = os.waitstatus_to_exitcode(status)
        self._loop.remove_reader(self._fd)
        os.close(self._fd)
        if not self._exited.done():
            self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


class ForkTemplate:
    """A process that imported ``module`` (a worker program with ``main(argv)``) and waits;
    ``spawn`` of ``[python, "-m", module, *args]`` then clones it instead of starting an
    interpreter. The clone starts a new session, takes the log as stdout/stderr, the given
    environment and working directory, and runs ``module.main(args)``; it is this
    process's child (``ClonedProcess``). The template stays single-threaded (a clone
    copies only the calling thread) and refuses to clone otherwise; it ends with this
    process (death signal, and the end of its stdin)."""

    def __init__(self, python: str, module: str, env: dict[str, str], log_path: Path) -> None:
        self.python, self.module, self.env, self.log_path = python, module, env, log_path
        self.process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self, timeout: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # numpy's OpenBLAS would start a thread at import: the template must stay single-threaded
        env = {**self.env, "OPENBLAS_NUM_THREADS": "1"}
        with open(self.log_path, "ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                self.python, "-m", __name__, TEMPLATE_ARG, self.module, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True, env=env)
        try:
            reply = await self._reply(timeout)
            if reply.get("event") != "ready":
                raise WorkerLost(f"fork template of {self.module} answered {reply}")
        except BaseException:
            await self.stop()
            raise

    async def _reply(self, timeout: float) -> dict:
        assert self.process is not None and self.process.stdout is not None
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        except TimeoutError:
            raise WorkerLost(f"fork template of {self.module} silent for {timeout:.0f}s") from None
        if not line:
            raise WorkerLost(f"fork template of {self.module} exited ({await self.process.wait()})")
        return json.loads(line)

    async def spawn(self, role: str, name: str, argv: list[str], log_path: Path, url: str | None = None,
                    env: dict | None = None, timeout: float = 10.0) -> Proc:
        """As ``spawn``, by a clone of the template; raises WorkerLost when it cannot."""
        if argv[:3] != [self.python, "-m", self.module]:
            raise WorkerLost(f"the fork template runs {self.module}, not {argv[:3]}")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        request = {"args": argv[3:], "env": dict(os.environ if env is None else env), "log": str(log_path),
                   "cwd": os.getcwd()}
        async with self._lock:  # one request and its reply at a time
            if not self.alive:
                raise WorkerLost(f"the fork template of {self.module} is not running")
            assert self.process is not None and self.process.stdin is not None
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                await self.process.stdin.drain()
            except (ConnectionError, OSError) as exc:
                raise WorkerLost(f"fork template of {self.module}: {exc}") from exc
            reply = await self._reply(timeout)
        if "pid" not in reply:
            raise WorkerLost(f"fork template of {self.module} could not clone: {reply.get('error')}")
        return Proc(role=role, name=name, process=ClonedProcess(int(reply["pid"])), log_path=log_path, url=url,
                    cloned=True)

    async def stop(self, timeout: float = 10.0) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), timeout)


def _clone_parent() -> int:
    """fork() whose child is a child of this process's parent (``CLONE_PARENT``): 0 in the
    child, its pid in the caller. Python's own before/after-fork steps run as for os.fork;
    the GIL is held throughout (``PyDLL``)."""
    api = ctypes.pythonapi
    libc = ctypes.PyDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    api.PyOS_BeforeFork()
    pid = libc.syscall(ctypes.c_long(_SYS_CLONE[platform.machine()]),
                       ctypes.c_ulong(_CLONE_PARENT | signal.SIGCHLD), None, None, None, None)
    if pid == 0:
        api.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


def _run_clone(main, request: dict, started: int) -> None:
    """In the clone: become a worker as ``spawn`` starts one, run ``main``, never return.
    ``started`` is closed once the clone leads its own session: the template replies only
    then, so a fence right after the reply reaches the clone's group (as after a spawn)."""
    code = 1
    try:
        os.setsid()
        os.close(started)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 1 << 16)  # the template's pipes and files are not the worker's
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.argv[0], *request["args"]]
        code = main(request["args"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code or 0)


def _template_main(module: str) -> int:
    """The template: import ``module``, say ready, clone on each request line of stdin."""
    with contextlib.suppress(OSError, AttributeError):  # never outlive the supervisor
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    main = importlib.import_module(module).main
    out = sys.stdout

    def reply(**fields) -> None:
        out.write(json.dumps(fields) + "\n")
        out.flush()

    reply(event="ready", pid=os.getpid())
    for line in sys.stdin:  # ends when the supervisor closes the pipe (or dies)
        request = json.loads(line)
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            reply(error=f"the template has {threads} threads; it clones only single-threaded")
            continue
        wait_fd, started = os.pipe()
        try:
            pid = _clone_parent()
        except OSError as exc:
            os.close(wait_fd)
            os.close(started)
            reply(error=str(exc))
            continue
        if pid == 0:
            os.close(wait_fd)
            _run_clone(main, request, started)
        os.close(started)
        os.read(wait_fd, 1)  # EOF once the clone has its own session (or has died)
        os.close(wait_fd)
        reply(pid=pid)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == [TEMPLATE_ARG]:
    sys.exit(_template_main(sys.argv[2]))
