"""What each thread of a py-spy profile ran, in time order: runs of the same innermost
frames, with their start and length in ms. A flame graph sums a thread's samples; a
handover's question is *when* a loop was busy (a 39 ms stall right after a promotion is
invisible in the totals of a 1 s window). Reads py-spy's ``--format chrometrace`` (begin /
end events with py-spy's own timestamps, so a sampler that falls behind does not stretch
the time axis).

    python3 benchmarks/_pyspy_timeline.py PROFILE.json [--thread MainThread] [--until-ms 300]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

# innermost frames of a thread that waits (py-spy's --idle samples them too)
IDLE_LEAVES = {"select", "poll", "epoll_wait", "wait", "sleep", "Runner.run", "run_forever", "_run_once",
               "recv_pyobj", "recv", "recv_multipart", "get", "acquire", "_wait_for_tstate_lock", "read", "epoll_pwait", "clock_nanosleep",
               "Condition.wait", "Event.wait", "Socket.recv_pyobj"}


def thread_runs(events: list[dict]) -> dict[tuple, list[tuple[float, list[str]]]]:
    """Per (pid, tid): (time in ms, the stack from then on) at every change of stack."""
    stacks: dict[tuple, list[str]] = defaultdict(list)
    changes: dict[tuple, list[tuple[float, list[str]]]] = defaultdict(list)
    for ev in sorted((e for e in events if e.get("ph") in ("B", "E")), key=lambda e: (e["ts"], e["ph"] == "B")):
        key = (ev["pid"], ev["tid"])
        stack = stacks[key]
        if ev["ph"] == "B":
            stack.append(ev["name"])  # with --subprocesses/--threads: "process N:..." and "thread (N): name" first
        elif stack:
            stack.pop()
        changes[key].append((ev["ts"] / 1e3, list(stack)))
    return changes


def _label(changes: list[tuple[float, list[str]]]) -> str:
    """``process:thread`` from py-spy's pseudo-frames (``process N:"cmd"``, ``thread (N): name``)."""
    for _, stack in changes:
        proc = next((f for f in stack if f.startswith("process ")), "")
        thread = next((f for f in stack if f.startswith("thread (")), "")
        if thread:
            cmd = proc.partition(":")[2].strip('"')
            short = cmd if cmd.startswith("sglang::") else (cmd.split()[2] if len(cmd.split()) > 2 else cmd)
            return f"{short}: {thread.partition(': ')[2]}"
    return "?"


def segments(changes: list[tuple[float, list[str]]], depth: int = 3) -> list[tuple[float, float, str]]:
    """(start_ms, length_ms, what): ``what`` is the ``depth`` innermost frames (innermost
    last), ``idle`` for a known wait; consecutive runs of the same ``what`` merged."""
    out: list[list] = []
    for (t, stack), (t_next, _) in zip(changes, changes[1:], strict=False):
        if t_next <= t:
            continue
        frames = [f for f in stack if not f.startswith(("process ", "thread ("))]
        what = "idle" if not frames or frames[-1] in IDLE_LEAVES else " > ".join(frames[-depth:])
        if out and out[-1][2] == what and abs(out[-1][0] + out[-1][1] - t) < 1e-6:
            out[-1][1] += t_next - t
        else:
            out.append([t, t_next - t, what])
    return [(s, n, w) for s, n, w in out]


def timeline(path: Path, thread: str = "", until_ms: float = 300.0, min_ms: float = 0.5, depth: int = 3,
             since_ms: float = 0.0) -> str:
    """Each thread's busy runs of at least ``min_ms`` that start between ``since_ms`` and ``until_ms``."""
    events = json.loads(path.read_text())
    lines = []
    for key, changes in sorted(thread_runs(events).items()):
        name = _label(changes)
        if thread and thread not in name:
            continue
        runs = [r for r in segments(changes, depth) if since_ms <= r[0] < until_ms]
        busy = sum(min(n, until_ms - s) for s, n, w in runs if w != "idle")
        lines.append(f"== pid {key[0]} {name}: busy {busy:.1f} ms of {since_ms:.0f}-{until_ms:.0f} ms")
        lines += [f"{s:7.1f} +{n:6.1f}  {w}" for s, n, w in runs if w != "idle" and n >= min_ms]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--thread", default="", help="only threads whose name contains this")
    p.add_argument("--since-ms", type=float, default=0.0)
    p.add_argument("--until-ms", type=float, default=300.0)
    p.add_argument("--min-ms", type=float, default=0.5)
    p.add_argument("--depth", type=int, default=3)
    args = p.parse_args()
    print(timeline(args.profile, args.thread, args.until_ms, args.min_ms, args.depth, args.since_ms))


if __name__ == "__main__":
    main()
