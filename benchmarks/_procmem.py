"""The one way benchmarks measure a process tree's memory: ``/proc/<pid>/smaps_rollup`` of
the process and its descendants (an SGLang server is three processes: HTTP, scheduler,
detokenizer). RSS counts shared pages in every process that touched them, PSS splits them
among the sharers, "private" is memory no other process shares. Linux only."""

from __future__ import annotations

import subprocess
from pathlib import Path

FIELDS = ("rss", "pss", "shared", "private")


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


def rollup(pid: int) -> dict[str, float]:
    """MiB of one process, by ``FIELDS``; OSError when it is gone."""
    lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    f = {key: int(value.split()[0]) / 1024 for key, value in (line.split(":", 1) for line in lines)}
    return {"rss": f["Rss"], "pss": f["Pss"], "shared": f["Shared_Clean"] + f["Shared_Dirty"],
            "private": f["Private_Clean"] + f["Private_Dirty"]}


def tree_mib(pid: int, fields: tuple[str, ...] = FIELDS) -> tuple[int, dict[str, float]]:
    """(processes measured, MiB by field summed over them, rounded to 0.1); a process that
    exits while being read is left out."""
    procs = []
    for p in tree(pid):
        try:
            procs.append(rollup(p))
        except OSError:
            continue
    return len(procs), {k: round(sum(m[k] for m in procs), 1) for k in fields}


def gpu_mib() -> dict[int, float]:
    """Per-process GPU memory (MiB) from nvidia-smi; empty without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [line.split(",") for line in out.strip().splitlines() if "," in line]
    return {int(a): float(b) for a, b in rows}


def tree_gpu_mib(gpu: dict[int, float], pid: int) -> float | None:
    """GPU MiB of a process and its descendants (an SGLang server's scheduler holds it)."""
    used = [gpu[p] for p in tree(pid) if p in gpu]
    return sum(used) if used else None


def gpu_by_process(gpu: dict[int, float], pid: int) -> dict[str, float]:
    """GPU MiB of each process of a server's tree that holds any, by ``pid name``: which of
    its processes (HTTP process, scheduler, detokenizer) holds a CUDA context."""
    out = {}
    for p in tree(pid):
        if p in gpu:
            try:
                name = Path(f"/proc/{p}/comm").read_text().strip()
            except OSError:
                name = "?"
            out[f"{p} {name}"] = gpu[p]
    return out
