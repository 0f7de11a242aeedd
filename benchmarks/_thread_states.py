"""Every thread of one process in the kernel's view, sampled from outside it (no GIL needed).

The shadow's HTTP process stalls 21-28 ms after an adoption with the GIL held: its own
sampler thread gets no turn then, and py-spy either samples without pausing it (no C
frames) or pauses it per sample (the handover then takes 755 ms). This sampler is another
process: every ``--every-ms`` it reads each thread's state, CPU time (schedstat, ns) and
current system call from ``/proc/PID/task``, through file descriptors opened once (a
``pread`` each, a few us), so it places the stall on the same monotonic clock as the
benchmark's kill and says which thread ran meanwhile. Linux only, standard library only.

    python3 benchmarks/_thread_states.py --pid 1234 --seconds 60 --out states.json
    python3 benchmarks/_thread_states.py --summary states.json --since-ms 1000 --until-ms 1400
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# the names of the waits an event loop makes, as the in-process sampler of the KV hook names them
sys.path.append(str(Path(__file__).resolve().parents[1] / "belayer_engine" / "backends" / "sglang" / "kv_hooks"))
from belayer_kv_threadstate import SYSCALLS  # noqa: E402 (standard library only)

RESCAN_S = 0.05  # new threads are found this often


class _Task:
    def __init__(self, root: Path, tid: int):
        self.tid = tid
        self.name = (root / "comm").read_text().strip()
        self.fds = [os.open(root / f, os.O_RDONLY) for f in ("stat", "schedstat", "syscall")]

    def read(self) -> tuple[str, int, str] | None:
        """(state letter, ns on a CPU, system call or "running"); None once the thread is gone."""
        try:
            stat, sched, call = (os.pread(fd, 512, 0) for fd in self.fds)
        except OSError:
            return None
        if not stat:
            return None
        state = stat.rpartition(b")")[2].split()[0].decode()
        first = call.split()[0].decode() if call.split() else "?"
        return state, int(sched.split()[0]), SYSCALLS.get(int(first), first) if first.isdigit() else first

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def sample(pid: int, seconds: float, every_s: float) -> dict:
    """Samples every thread of ``pid`` for ``seconds``: ``{"t": [...], "threads": {tid: {name,
    samples: [[t index, state, on_cpu_ns, call], ...]}}}``, times on CLOCK_MONOTONIC (s)."""
    tasks: dict[int, _Task] = {}
    out: dict = {"pid": pid, "every_s": every_s, "t": [], "threads": {}}
    end = time.monotonic() + seconds
    next_scan = 0.0
    while (now := time.monotonic()) < end:
        if now >= next_scan:
            next_scan = now + RESCAN_S
            try:
                for entry in os.listdir(f"/proc/{pid}/task"):
                    tid = int(entry)
                    if tid not in tasks:
                        try:
                            tasks[tid] = _Task(Path(f"/proc/{pid}/task/{entry}"), tid)
                        except OSError:
                            continue
                        out["threads"][str(tid)] = {"name": tasks[tid].name, "samples": []}
            except FileNotFoundError:
                break  # the process is gone
        index = len(out["t"])
        out["t"].append(now)
        for tid, task in list(tasks.items()):
            got = task.read()
            if got is None:
                task.close()
                del tasks[tid]
                continue
            out["threads"][str(tid)]["samples"].append([index, *got])
        time.sleep(max(0.0, every_s - (time.monotonic() - now)))
    for task in tasks.values():
        task.close()
    return out


def window(data: dict, since_s: float, until_s: float) -> dict:
    """The samples taken between ``since_s`` and ``until_s`` (a small file to keep)."""
    keep = [i for i, t in enumerate(data["t"]) if since_s <= t <= until_s]
    new_index = {old: new for new, old in enumerate(keep)}
    threads = {tid: {"name": th["name"], "samples": [[new_index[s[0]], *s[1:]] for s in th["samples"] if s[0] in new_index]}
               for tid, th in data["threads"].items()}
    return {**data, "t": [data["t"][i] for i in keep], "threads": {k: v for k, v in threads.items() if v["samples"]}}


def _merge_short(spans: list[tuple], min_ms: float) -> list[tuple]:
    """Consecutive spans shorter than ``min_ms`` become one ``short runs`` span (an event loop
    waking for a few ms at a time), so the long ones (a stall) stand out."""
    out: list[tuple] = []
    for span in spans:
        short = 1e3 * (span[1] - span[0]) < min_ms
        if short and out and out[-1][2] == "short runs":
            t0, _, what, cpu, n = out[-1]
            out[-1] = (t0, span[1], what, cpu + span[3], n + span[4])
        else:
            out.append((span[0], span[1], "short runs", span[3], span[4]) if short else span)
    return out


def summary(data: dict, since_s: float, until_s: float, min_ms: float = 3.0) -> str:
    """Per thread, runs of one (state, call) between ``since_s`` and ``until_s`` (monotonic),
    each with its CPU time: ``+12.3 ms R running (on a CPU 12.1 ms)``; times in ms from
    ``since_s``; runs under ``min_ms`` in a row are one ``short runs`` line. Threads idle
    throughout (one sleeping run, no CPU time) are one line."""
    ts = data["t"]
    lines = []
    for tid, thread in sorted(data["threads"].items(), key=lambda kv: int(kv[0])):
        rows = [s for s in thread["samples"] if since_s <= ts[s[0]] <= until_s]
        if not rows:
            continue
        runs: list[list] = []  # [start t, end t, state, call, cpu ns at start, cpu ns at end, samples]
        for index, state, cpu, call in rows:
            t = ts[index]
            key_call = call if state != "R" else "running"
            if runs and runs[-1][2] == state and runs[-1][3] == key_call:
                runs[-1][1], runs[-1][5] = t, cpu
                runs[-1][6] += 1
            else:
                runs.append([t, t, state, key_call, cpu, cpu, 1])
        busy = (rows[-1][2] - rows[0][2]) / 1e6
        head = f"== thread {tid} ({thread['name']}{', main' if tid == str(data['pid']) else ''}): " \
               f"on a CPU {busy:.1f} ms of {1e3 * (ts[rows[-1][0]] - ts[rows[0][0]]):.1f} ms sampled"
        if len(runs) == 1 and busy < 0.5:
            lines.append(f"{head}; {runs[0][2]} {runs[0][3]} throughout")
            continue
        lines.append(head)
        spans = []  # a run lasts until the next run's first sample; its CPU time likewise
        for i, (t0, t1, state, call, c0, c1, n) in enumerate(runs):
            t_end, c_end = (runs[i + 1][0], runs[i + 1][4]) if i + 1 < len(runs) else (t1, c1)
            spans.append((t0, t_end, f"{state} {call}", c_end - c0, n))
        for t0, t1, what, cpu, n in _merge_short(spans, min_ms):
            lines.append(f" {1e3 * (t0 - since_s):7.1f} +{1e3 * (t1 - t0):6.1f} ms  {what:<24} "
                         f"(on a CPU {cpu / 1e6:.1f} ms, {n} samples)")
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False) if since_s <= a <= until_s]
    if gaps:
        lines.append(f"sampler: {len(gaps) + 1} samples, longest gap {1e3 * max(gaps):.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pid", type=int, help="the process to sample")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--every-ms", type=float, default=1.0)
    p.add_argument("--out", type=Path, help="JSON of the samples (with --pid)")
    p.add_argument("--summary", type=Path, help="print the runs of a JSON written before")
    p.add_argument("--since-ms", type=float, default=0.0, help="with --summary: from (ms after the first sample)")
    p.add_argument("--until-ms", type=float, default=float("inf"))
    args = p.parse_args(argv)
    if args.summary is not None:
        try:
            data = json.loads(args.summary.read_text())
            if not isinstance(data, dict) or not {"t", "threads", "pid"} <= data.keys():
                raise ValueError("no pid, t and threads")
        except (OSError, ValueError) as exc:
            p.error(f"--summary {args.summary}: not a samples file of this script ({type(exc).__name__}: {exc})")
        t0 = data["t"][0] if data["t"] else 0.0
        print(summary(data, t0 + args.since_ms / 1e3, t0 + args.until_ms / 1e3))
        return 0
    if args.pid is None or args.out is None:
        p.error("--pid and --out (or --summary)")
    if args.seconds <= 0 or args.every_ms <= 0:
        p.error("--seconds and --every-ms must be positive")
    if not Path(f"/proc/{args.pid}").exists():
        p.error(f"no process {args.pid}")
    print("sampling", flush=True)  # the caller waits for this line
    args.out.write_text(json.dumps(sample(args.pid, args.seconds, args.every_ms / 1e3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
