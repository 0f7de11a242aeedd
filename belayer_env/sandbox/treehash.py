"""``tree_hash``: one digest of a sandbox's file tree, computed inside the container.

Covers paths, file types, modes, owners, file contents, symlink targets, device numbers
and hardlink structure; not timestamps (a restore may legitimately touch them) and not
the per-container files Docker bind-mounts (/etc/hosts, /etc/hostname, /etc/resolv.conf).
Two trees hash equal iff a process could not tell them apart by reading them. Used by the
checkpoint tests and the consistency harness.
"""

from __future__ import annotations

import json
import shlex

from belayer_core.errors import SandboxLost
from belayer_env.sandbox.config import OUTPUT_DIR
from belayer_env.sandbox.protocol import Sandbox

DEFAULT_EXCLUDE = ("/proc", "/sys", "/dev", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf")

_SCRIPT = r"""
import hashlib, json, os, stat, sys
root, exclude = sys.argv[1], set(json.loads(sys.argv[2]))
h, links = hashlib.sha256(), {}
def entry(dfd, name, p):  # through the parent's fd: paths past PATH_MAX hash too
    st = os.lstat(name, dir_fd=dfd)
    m = st.st_mode
    rec = [p, oct(m), str(st.st_uid), str(st.st_gid)]
    if stat.S_ISREG(m):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in links:
            rec.append("link=" + links[key])
        else:
            links[key] = p
            fh = hashlib.sha256()
            with open(name, "rb", opener=lambda n, fl: os.open(n, fl | os.O_NOFOLLOW, dir_fd=dfd)) as f:
                for b in iter(lambda: f.read(1 << 20), b""):
                    fh.update(b)
            rec.append(fh.hexdigest())
    elif stat.S_ISLNK(m):
        rec.append("->" + os.readlink(name, dir_fd=dfd))
    elif stat.S_ISCHR(m) or stat.S_ISBLK(m):
        rec.append("dev=%d" % st.st_rdev)
    h.update("\0".join(rec).encode("utf-8", "surrogateescape") + b"\n")
    return stat.S_ISDIR(m)
def walk(dfd, d):
    for name in sorted(os.listdir(dfd)):
        p = os.path.join(d, name)
        if p in exclude:
            continue
        if entry(dfd, name, p):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            try:
                walk(fd, p)
            finally:
                os.close(fd)
if root not in exclude:
    entry(None, root, root)
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    walk(top, root)
print(h.hexdigest())
"""


def tree_hash(sandbox: Sandbox, root: str = "/", exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
              timeout: float = 120.0) -> str:
    """sha256 (hex) over the tree under ``root`` in ``sandbox``, skipping ``exclude`` paths.

    The sandbox's own plumbing (``OUTPUT_DIR``, where command output is staged) is always
    skipped: it is not the agent's state, and hashing changes it.
    """
    skip = [*exclude, OUTPUT_DIR]
    cmd = f"python3 -c {shlex.quote(_SCRIPT)} {shlex.quote(root)} {shlex.quote(json.dumps(skip))}"
    result = sandbox.execute(cmd, timeout=timeout)
    out = result["output"].strip()
    if result["returncode"] != 0 or len(out) != 64:
        raise SandboxLost(f"tree_hash in {sandbox.name} failed (exit {result['returncode']}): {out[-500:]}")
    return out
