"""A cgroup yard for CRIU's dumps: the host's own cgroup mounts, one link per hierarchy.

Why: without a yard, CRIU mounts every cgroup hierarchy afresh inside each dump's freeze to
walk the container's cgroups (``collect_cgroups`` in CRIU's ``cgroup.c``); on this VM (cgroup
v1 hierarchies beside the unified v2 one) that took ~17 ms of every frozen window, with a
yard 0.04 ms. CRIU's ``cgroup-yard`` option names a directory holding one entry per
hierarchy, named as CRIU names it: ``unified`` for cgroup2, ``systemd`` for ``name=systemd``,
otherwise the controllers as ``/proc/self/cgroup`` lists them (``cpu,cpuacct`` when
comounted). ``make`` builds it in a dump's private work dir: symlinks to where the host
mounts each hierarchy at its root. CRIU reads the same cgroups either way; the images are
the same (tested). Dumps only: a restore (Docker's start) lets CRIU mount its own.

Where some hierarchy of this process is not mounted at its root anywhere (a host that
mounts them elsewhere or not at all), there is no yard and CRIU mounts them as before.
"""

from __future__ import annotations

import functools
from pathlib import Path

from belayer_core.procfs import mount_roots

YARD = "cgroup-yard"


def _yard_name(controllers: str) -> str:
    if controllers == "":
        return "unified"
    return controllers.removeprefix("name=")


@functools.cache
def hierarchies() -> tuple[tuple[str, str], ...] | None:
    """``(yard name, mount point)`` for every hierarchy this process is in, or None when one
    of them is not mounted at its root here (read once per process: hosts do not remount
    their cgroup hierarchies under running containers)."""
    try:
        cgroup_lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    roots = [(m.fstype, set(m.super_options.split(",")), m.target) for m in mount_roots()
             if m.root == "/" and m.fstype in ("cgroup", "cgroup2")]
    links: dict[str, str] = {}
    for line in cgroup_lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            return None
        controllers = parts[1]
        wanted = set(controllers.split(",")) if controllers else set()
        target = next((point for fstype, options, point in roots
                       if (fstype == "cgroup2") == (not controllers) and wanted <= options), None)
        if target is None:
            return None
        links[_yard_name(controllers)] = target
    return tuple(sorted(links.items())) or None


def make(work: Path) -> Path | None:
    """The yard for one dump, inside its (0700) work dir; None: let CRIU mount its own."""
    links = hierarchies()
    if not links:
        return None
    yard = work / YARD
    yard.mkdir(mode=0o700)
    for name, target in links:
        (yard / name).symlink_to(target)
    return yard
