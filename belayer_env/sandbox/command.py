"""How one command runs inside a sandbox: the in-container wrapper every ``execute`` starts
(command on stdin, output through a FIFO kept head + tail on the sandbox's tmpfs, a report
line at the end) and the host's reader of the exec stream."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

from docker.utils.socket import frames_iter

from belayer_core.errors import SandboxLost
from belayer_env.sandbox.output import OutputCollector

MAX_COMMAND_BYTES = 2**20
"""Longest command ``execute`` takes (UTF-8 bytes). It travels on the exec's stdin, not in its
argv, so the kernel's 128 KiB per-argument limit and containerd's message limit never apply."""
CHUNK_BYTES = 2**20  # the in-sandbox keeper rotates chunk files of this size for the tail
RESERVED_PIDS = 6
"""Process slots the wrapper holds (idle subshells) while the command runs and frees when it
ends: a command whose background jobs take every other slot of the sandbox's pids limit still
gets its report (a few forks), and the next exec still starts (runc's ``init`` needs 6 or 7
slots for its threads, else "OCI runtime exec failed")."""
WRAPPER_PIDS = RESERVED_PIDS + 5
"""Process slots the wrapper needs beside its own (the reserve, keeper, its ``head``, ``timeout``,
the login shell, what its profile forks). With fewer free under the sandbox's pids limit (its
own processes hold the rest), the command runs *direct* (``timeout`` and ``bash -c``, output
straight to the exec, a reserve of all but one spare slot), so the agent can still run
``pkill`` or ``kill`` there, and the slots come free again for the exec after it."""

# Runs every command. The command arrives on stdin and is saved to a file; it runs with its
# output (stdout and stderr merged) on a FIFO, never on the exec pipe. A keeper (``drain``)
# reads the FIFO and keeps only the head (H bytes) and the last two chunks (C >= T bytes
# each) on the sandbox's private tmpfs, counting the rest: output of any size can neither
# fill the tmpfs nor change the command's exit code (a full FIFO blocks the writer; it never
# fails it). A background job the command leaves behind keeps the FIFO, not a pipe to
# containerd-shim, so it neither holds the exec open nor dies of EPIPE, and CRIU can
# checkpoint it and its keeper; once its command has been collected, the keeper goes on
# draining into one chunk file. When the command exits, the wrapper waits for the keeper's
# end of stream (or, while background jobs still hold the FIFO, until the keeper has read
# everything: the FIFO is empty and its ``head`` is blocked reading it; bounded), prints
# the head and the tail to the exec pipe and "belayer-meta RC TOTAL SENT" to stderr, and exits 0.
# So the host knows a complete result (exit 0, a report, SENT bytes received) from one the
# transport cut (SandboxLost) and from a wrapper the command killed (its signal exit code).
# Under the pids limit: with fewer than R slots free beside its own (F of M, from the host; or
# read with builtins, no fork), it says "belayer-direct MAX IN-USE" and runs the command *direct*:
# ``timeout`` and ``bash -c`` (no login profile), output straight to the exec, the exec's exit
# code the command's; it holds all but 3 of those slots (at most RS) in reserve meanwhile, or
# with 3 or fewer execs ``timeout`` itself. Otherwise RS reserve processes hold slots while the
# command runs. Either way the reserve ends before the report, whose few forks then fit, and
# its slots are free for the next exec, even when the command's background jobs took the rest.
EXEC_WRAPPER = r"""
T=$1 H=$2 TL=$3 ID=$4 K=$5 C=$6 CWD=$7 R=$8 RS=$9 F=${10} M=${11}
if [ "$F" = - ]; then  # the host could not tell: ask the cgroup (with builtins: no fork)
  for g in /sys/fs/cgroup/pids /sys/fs/cgroup; do
    { read -r M <"$g/pids.max" && read -r c <"$g/pids.current"; } 2>/dev/null && break
  done
  [ -n "$c" ] && [ -n "$M" ] && [ "$M" != max ] && F=$((M - c))
fi
if [ "$F" != - ] && [ "$F" -lt "$R" ]; then
  IFS= read -r -d '' cmd
  echo "belayer-direct $M $((M - F))" >&2
  exec 2>&1 </dev/null
  cd -- "$CWD" || exit 1
  n=$((F - 3)); [ "$n" -gt "$RS" ] && n=$RS  # a reserve, if the command keeps a fork or two
  w=/run/belayer/c.$ID
  if [ "$n" -le 0 ] || ! { mkdir -m 700 "$w" && mkfifo -m 600 "$w/r"; } 2>/dev/null; then
    exec timeout -k "$K" "$T" bash -c "$cmd"
  fi
  echo $$ >"$w/wpid"; exec 9<>"$w/r"
  rs=(); for ((i = 0; i < n; i++)); do { read -r _ <"$w/r"; } >/dev/null 2>&1 9>&- & rs+=($!); done
  timeout -k "$K" "$T" bash -c "$cmd" 9>&- &
  pid=$!; wait "$pid"; rc=$?
  { kill "${rs[@]}"; wait "${rs[@]}"; } 2>/dev/null; exec 9>&-
  rm -rf "$w"
  exit "$rc"
fi
d=/run/belayer; [ -d "$d" ] && [ -w "$d" ] || { d=/tmp/.belayer; mkdir -p -m 700 "$d"; }
for o in "$d"/c.*; do
  [ -d "$o" ] || continue
  p=; q=; read -r q <"$o/wpid" 2>/dev/null; read -r p <"$o/pid" 2>/dev/null
  [ -n "$q" ] && kill -0 "$q" 2>/dev/null && continue  # its command is still running or being collected
  if [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then : >"$o/x"; else rm -rf "$o"; fi
done
w=$d/c.$ID; mkdir -m 700 "$w" || exit 125
echo $$ >"$w/wpid"
cat >"$w/cmd"; printf '%s' "$CWD" >"$w/cwd"
mkfifo -m 600 "$w/p" "$w/q" "$w/r" || exit 125
echo 0 >"$w/n"; : >"$w/h"; : >"$w/c.0"; : >"$w/c.1"
exec 5<>"$w/p" 6<>"$w/q" 8<"$w/p"
u=; command -v stdbuf >/dev/null && u="stdbuf -o0"  # head's stdio would hold bytes back
drain() {
  echo "$BASHPID" >"$w/pid"
  $u head -c "$H" >"$w/h"
  n=0
  while :; do
    echo "$n" >"$w/n"
    f=$w/c.$((n % 2)); [ -e "$w/x" ] && f=$w/c.d
    exec 3>"$f"; $u head -c "$C" >&3
    pos=; { read -r _ pos <"/proc/$BASHPID/fdinfo/3"; } 2>/dev/null  # our offset: a truncation can't move it
    exec 3>&-
    [ "${pos:-$(stat -c %s "$f")}" = "$C" ] || break
    n=$((n + 1))
  done
  echo >&6
}
drain <"$w/p" >/dev/null 2>&1 5>&- 8>&- &
dp=$!
exec 9<>"$w/r"  # reserve: each holds a slot until ended (or until this wrapper dies: EOF)
rs=(); for ((i = 0; i < RS; i++)); do { read -r _ <"$w/r"; } >/dev/null 2>&1 </dev/null 5>&- 6>&- 8>&- 9>&- & rs+=($!); done
start=$SECONDS
timeout -k "$K" "$T" bash -lc "cd -- \"\$(< $w/cwd)\" && eval \"\$(< $w/cmd)\"" >"$w/p" 2>&1 </dev/null 5>&- 6>&- 8>&- 9>&- &
pid=$!; wait "$pid"; rc=$?
[ "${#rs[@]}" = 0 ] || { kill "${rs[@]}"; wait "${rs[@]}"; } 2>/dev/null; exec 9>&-  # for the report, the next exec
if { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && [ $((SECONDS - start)) -ge "${T%.*}" ]; then
  while kill -KILL -- "-$pid" 2>/dev/null; do :; done
fi
drained() {
  read -t 0 -u 8 && return 1
  local kids=() k wc
  read -r -a kids <"/proc/$dp/task/$dp/children" 2>/dev/null
  [ "${#kids[@]}" -gt 0 ] || return 1
  for k in "${kids[@]}"; do
    wc=; read -r wc <"/proc/$k/wchan" 2>/dev/null
    case "$wc" in *pipe_read*) ;; *) return 1 ;; esac
  done
}
kill -0 -- "-$pid" 2>/dev/null || exec 5>&-
i=0 eof=
until read -t 0.02 -u 6 _ && eof=1; do
  drained && break
  i=$((i + 1)); [ "$i" -ge 150 ] && break
done
[ -n "$eof" ] && wait "$dp"  # it has signalled its end: let it exit, so its staging goes now
exec 5>&- 8>&-
sz() { stat -c %s "$1" 2>/dev/null || echo 0; }  # 0 when the command removed our files
for _ in 1 2 3; do
  n=0; read -r n <"$w/n"
  set -- $(stat -c %s "$w/h" "$w/c.0" "$w/c.1" 2>/dev/null)
  if [ "$#" = 3 ]; then hs=$1 s0=$2 s1=$3; else hs=$(sz "$w/h") s0=$(sz "$w/c.0") s1=$(sz "$w/c.1"); fi
  n2=; read -r n2 <"$w/n"; [ "$n" = "$n2" ] && break
done
if [ $((n % 2)) = 0 ]; then cur=$w/c.0 cs=$s0 prev=$w/c.1; else cur=$w/c.1 cs=$s1 prev=$w/c.0; fi
total=$((hs + n * C + cs)); rest=$((total - hs)); keep=$rest; [ "$keep" -gt "$TL" ] && keep=$TL
if [ "$n" -gt 0 ]; then have=$(($(sz "$prev") + cs)); else have=$cs; fi
[ "$keep" -gt "$have" ] && keep=$have
# RC, bytes the command wrote, bytes sent below: fewer received means the transport was cut
echo "belayer-meta $rc $total $((hs + keep))" >&2
head -c "$hs" "$w/h" 2>/dev/null
if [ "$keep" -gt 0 ]; then
  if [ "$n" -gt 0 ]; then cat "$prev" "$cur"; else cat "$cur"; fi 2>/dev/null | tail -c "$keep"
fi
# a keeper still draining a background job: its files are truncated, never removed (its head
# goes on writing at its offset into a hole; it tells a full chunk by its own file offset, never
# by the file's size, which this truncation can zero between its head's exit and its check)
if kill -0 "$dp" 2>/dev/null; then : >"$w/x"; : >"$w/h"; : >"$w/c.0"; : >"$w/c.1"; rm -f "$w/cmd"; else rm -rf "$w"; fi
exit 0  # the command's code is in the report: a nonzero exec exit means the wrapper itself died
"""


class StreamReader:
    """Reads a multiplexed exec stream on a thread into a bounded collector."""

    def __init__(self, sock: Any, collector: OutputCollector):
        self._sock = sock
        self.collector = collector
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._stderr = b""
        self.received = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="belayer-exec-reader")
        self._thread.start()

    def _run(self) -> None:
        try:
            for stream, data in frames_iter(self._sock, tty=False):
                if stream == 2:
                    self._stderr += data
                else:
                    self.received += len(data)
                    self.collector.feed(data)
        except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
            self.error = e
        finally:
            self.done.set()

    def send_and_close(self, data: bytes) -> None:
        """Write the command to the exec's stdin and half-close it (the wrapper reads to EOF)."""
        raw = getattr(self._sock, "_sock", self._sock)
        try:
            raw.sendall(data)
            raw.shutdown(socket.SHUT_WR)
        except OSError as e:
            raise SandboxLost(f"the exec stream broke while the command was sent ({e})") from e

    def apply_meta(self) -> tuple[int, int] | None:
        """Tell the collector the full output size the wrapper saw (it sends only head + tail);
        return (the command's exit code, the bytes the wrapper sent), or None when the report
        did not arrive (the wrapper did not run, was killed, or the stream was cut)."""
        for line in self._stderr.decode("utf-8", "replace").splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "belayer-meta" and all(p.isdigit() for p in parts[1:]):
                self.collector.total = max(self.collector.total, int(parts[2]))
                return int(parts[1]), int(parts[3])
        return None

    def direct(self) -> tuple[int, int] | None:
        """(pids limit, processes in use) when the wrapper ran the command direct (see
        ``WRAPPER_PIDS``: the exec's exit code is then the command's); None otherwise."""
        for line in self._stderr.decode("utf-8", "replace").splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "belayer-direct" and all(p.isdigit() for p in parts[1:]):
                return int(parts[1]), int(parts[2])
        return None

    def wrapper_errors(self) -> str:
        """What the wrapper itself printed to stderr (e.g. bash's "fork: Resource temporarily
        unavailable" when it could not fork at the pids limit): text from inside the sandbox."""
        return self._stderr.decode("utf-8", "replace")[-2000:]

    def close(self) -> None:
        raw = getattr(self._sock, "_sock", self._sock)
        with contextlib.suppress(OSError, AttributeError):
            raw.shutdown(2)
        with contextlib.suppress(OSError, AttributeError):
            self._sock.close()
        self._thread.join(timeout=2)
