"""Run caller code inside CRIU's own freeze (action scripts relayed over FIFOs), and read
CRIU's frozen-time statistics.

When CRIU freezes the container itself, everything it does before the freeze (start-up,
kernel probing, runc's own work, the version query) runs while the sandbox keeps going.
CRIU action scripts mark the window: ``pre-dump`` right before CRIU freezes the cgroup
(the caller freezes it first: CRIU's own freeze sleeps 100 ms whenever the first read
says FREEZING, which under load is nearly always), ``network-lock`` right after the tasks
are seized, ``post-dump`` after every image is written and before they are resumed,
``network-unlock`` just before CRIU lets them go. At each, the static hook set-up lists
in runc's CRIU config (``scripts/native/criu_loopback.c``; one exec, which the hook costs
anyway) finds this dump's relay in its environment, or, where that build is missing, a
script of the dump's own (``/bin/sh``, builtins only) does the same: write the event name
into one FIFO and, for ``pre-dump`` and ``post-dump``, read the answer from another,
opened so that the checkpointer is its only writer. A checkpointer that dies leaves that
read at EOF, which fails the dump (CRIU resumes the tasks); one that hangs is bounded by
the dump timeout (``runtime.dump`` kills runc, CRIU and the hook). The checkpointer is
checked by pid *and* start time, never a bare pid. A caller that died after freezing the
cgroup leaves a watcher that holds CRIU by a pidfd (``_WATCH``: no pid number that could
be reused) and thaws the cgroup once CRIU has exited, or after the dump timeout at the
latest.
"""

from __future__ import annotations

import os
import shlex
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from belayer_core.procfs import OwnerId

STATS_FILE = "stats-dump"
_ORPHANED = """alive() {{  # the checkpointer: pid {pid} *and* its start time (a pid alone may be reused), not a zombie
  local s
  read -r s 2>/dev/null </proc/{pid}/stat || return 1
  s=${{s##*) }}
  set -- $s
  [ "$1" != Z ] && [ "$1" != X ] && [ "${{20}}" = {start} ]
}}
exiting() {{  # the answer FIFO's last writer closed: the checkpointer is exiting; wait until it is gone
  local i=0
  while alive && [ $i -lt {polls} ]; do sleep 0.01; i=$((i + 1)); done
}}
orphaned() {{  # the checkpointer died: thaw what it froze once CRIU (an ancestor) has exited
  alive && return 1
  [ -n {freezer} ] && {python} -I -S -c {watch} $$ {freezer} {thawed} {bound} </dev/null >/dev/null 2>&1
  return 0
}}
"""
_WATCH = """
import os, select, sys
script, ctl, value, bound = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        head, _, tail = f.read().rpartition(")")
    return head.partition("(")[2], int(tail.split()[1])
chain, fd = [script], None
try:  # walk up from the script to CRIU (its parent, or an `sh -c` between), hold it by a pidfd
    while len(chain) < 5 and fd is None:
        parent = stat(chain[-1])[1]
        chain.append(parent)
        if stat(parent)[0] == "criu":
            fd = os.pidfd_open(parent)
    # still each one's parent after the pidfd was taken: that pidfd is this very CRIU
    if fd is not None and any(stat(c)[1] != p for c, p in zip(chain, chain[1:])):
        os.close(fd)
        fd = None
except (OSError, ValueError, IndexError):
    fd = None
if os.fork() == 0:  # the script (and CRIU) go on; this waits for CRIU's exit, never past bound
    if fd is not None:
        select.select([fd], [], [], bound)
    with open(ctl, "w") as f:
        f.write(value)
os._exit(0)
"""
_SCRIPT = """#!/bin/sh
# Belayer's CRIU action script for one dump, where set-up could not build the static hook
# that relays (belayer_env/host/loopback.py). CRIU execs it at every stage; dash builtins
# only on the way through the freeze.
{orphaned}answer() {{  # tell the checkpointer, then wait for its answer: EOF once it is gone
  # fd 3 reads the answer FIFO; the only writer left is the checkpointer (fd 5 was our own)
  exec 5<>{answer} 3<{answer} 5>&- 4<>{events}
  echo "$1" >&4
  if read -r reply <&3; then [ "$reply" = ok ]; exit; fi
  exiting
  orphaned
  exit 1  # fail: CRIU resumes the tasks
}}
case "$CRTOOLS_SCRIPT_ACTION" in
pre-dump) answer freeze ;;
network-lock) exec 4<>{events}; echo frozen >&4 ;;
post-dump) answer dumped ;;
network-unlock) exec 4<>{events}; echo resuming >&4; orphaned; exit 0 ;;
esac
"""


class CriuError(Exception):
    """CRIU/runc could not dump or restore (message carries the log's tail). Defined here, the
    lower of the two CRIU modules; ``runtime.CriuError`` is the same class. ``reason``: why,
    in one line (CRIU's own error line, not its whole log)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or (message.splitlines()[0][:300] if message else "CRIU failed")


class FreezeHooks(Protocol):
    """What a caller runs around CRIU's frozen window."""

    def freeze(self) -> None:
        """CRIU is about to freeze the cgroup (its own freeze polls in 100 ms steps): freeze
        it now, faster; raise to fail the dump."""

    def frozen(self) -> None:
        """The container's processes are stopped (start capturing what must match them)."""

    def before_resume(self) -> None:
        """The images are written; the processes resume when this returns (raise: fail)."""

    def resuming(self) -> None:
        """CRIU is about to let the processes go (it re-freezes a cgroup it found frozen)."""


class HookRelay:
    """The FIFOs + relay thread of one dump, and what makes CRIU call into them: the static
    hook set-up listed in runc's CRIU config, told by environment (``native``: ``env``), or
    an action script of this dump's own (``config_lines``). ``times`` holds monotonic
    stamps of the events seen (``freeze``, ``frozen``, ``dumped``, ``answered``,
    ``resuming``). ``orphan_thaw``: (freezer control file, thawed value) written once CRIU
    has exited when the checkpointer is found dead (it froze the cgroup for CRIU: nobody
    else would thaw it, and Docker does not know it is frozen)."""

    def __init__(self, work: Path, hooks: FreezeHooks, timeout_s: float, orphan_thaw: tuple[Path, str] | None = None,
                 *, native: bool = False):
        self.hooks = hooks
        self.error: BaseException | None = None
        self.times: dict[str, float] = {}
        events, answer = work / "criu-events", work / "criu-answer"
        os.mkfifo(events, 0o600)
        os.mkfifo(answer, 0o600)
        me = OwnerId.current()
        bound_s = max(1.0, timeout_s)
        bound = f"{bound_s:g}"
        self.env: dict[str, str] = {}
        """For runc's environment (CRIU and its action scripts inherit it)."""
        self.config_lines: list[str] = []
        """For this dump's CRIU config file."""
        if native:
            self.env = {"BELAYER_RELAY_EVENTS": str(events), "BELAYER_RELAY_ANSWER": str(answer),
                        "BELAYER_RELAY_OWNER": f"{me.pid} {me.start_time}", "BELAYER_RELAY_PYTHON": sys.executable,
                        "BELAYER_RELAY_WATCH": _WATCH, "BELAYER_RELAY_BOUND": bound}
            if orphan_thaw:
                self.env |= {"BELAYER_RELAY_THAW_FILE": str(orphan_thaw[0]), "BELAYER_RELAY_THAW_VALUE": orphan_thaw[1]}
        else:
            script = work / "criu-hook.sh"
            orphaned = _ORPHANED.format(pid=me.pid, start=me.start_time, python=shlex.quote(sys.executable),
                                        watch=shlex.quote(_WATCH), bound=bound, polls=int(bound_s * 100),
                                        freezer=shlex.quote(str(orphan_thaw[0])) if orphan_thaw else "''",
                                        thawed=shlex.quote(orphan_thaw[1]) if orphan_thaw else "''")
            script.write_text(_SCRIPT.format(orphaned=orphaned, answer=shlex.quote(str(answer)),
                                             events=shlex.quote(str(events))))
            script.chmod(0o700)
            self.config_lines = [f"action-script {script}"]
        self._events = os.open(events, os.O_RDWR)
        self._answer = os.open(answer, os.O_RDWR)
        self._thread = threading.Thread(target=self._relay, daemon=True, name="belayer-criu-hooks")
        self._thread.start()

    def _relay(self) -> None:
        with os.fdopen(os.dup(self._events), "rb", buffering=0) as f:
            buf = b""
            while True:
                chunk = f.read(64)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    event = line.decode(errors="replace").strip()
                    if event == "end":
                        return
                    self.times.setdefault(event, time.monotonic())
                    self._on(event)

    def _on(self, event: str) -> None:
        if event == "freeze":
            self._call(self.hooks.freeze)
            self._answer_now()
        elif event == "frozen":
            self._call(self.hooks.frozen)
        elif event == "dumped":
            if "frozen" not in self.times:  # no network namespace: no network-lock script
                self.times["frozen"] = self.times["dumped"]
                self._call(self.hooks.frozen)
            if self.error is None:
                self._call(self.hooks.before_resume)
            self.times["answered"] = time.monotonic()
            self._answer_now()
        elif event == "resuming":
            self._call(self.hooks.resuming)

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the dump
            self.error = self.error or e

    def _answer_now(self) -> None:
        os.write(self._answer, b"ok\n" if self.error is None else b"fail\n")

    def close(self) -> None:
        os.write(self._events, b"end\n")
        self._thread.join()
        os.close(self._events)
        os.close(self._answer)

    def check(self) -> None:
        """After a successful dump: the hooks must have run inside it."""
        if self.error is not None:
            raise self.error
        if "answered" not in self.times:
            raise CriuError("CRIU finished without running the post-dump action script: "
                            "nothing was captured inside its freeze")


def dump_stats(work: Path) -> dict[str, int]:
    """CRIU's own dump statistics (``stats-dump`` in the work dir): ``freezing_time`` and
    ``frozen_time`` (microseconds), pages scanned/written. Empty if unreadable."""
    try:
        raw = (work / STATS_FILE).read_bytes()
    except OSError:
        return {}
    if len(raw) < 12:
        return {}
    (size,) = struct.unpack_from("<I", raw, 8)
    entry = _fields(raw[12:12 + size])
    dump = entry.get(1)
    if not isinstance(dump, bytes):
        return {}
    names = {1: "freezing_time", 2: "frozen_time", 3: "memdump_time", 4: "memwrite_time",
             5: "pages_scanned", 6: "pages_skipped_parent", 7: "pages_written"}
    return {names[k]: v for k, v in _fields(dump).items() if k in names and isinstance(v, int)}


def _fields(buf: bytes) -> dict[int, int | bytes]:
    """The varint and length-delimited fields of one protobuf message (enough for stats)."""
    out: dict[int, int | bytes] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        kind = key & 7
        if kind == 0:
            out[key >> 3], i = _varint(buf, i)
        elif kind == 2:
            n, i = _varint(buf, i)
            out[key >> 3] = buf[i:i + n]
            i += n
        else:
            break
    return out


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i
