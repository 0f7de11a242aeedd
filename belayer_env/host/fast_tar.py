"""The ``tar`` CRIU runs for every tmpfs of a sandbox, at dump and at restore, made cheap.

Why: CRIU dumps every tmpfs of a container (Docker's ``/dev``, ``/dev/shm``,
``/sys/fs/cgroup``, the masked ``/sys/firmware`` and ``/proc/acpi``, the sandbox's
``/run/belayer``) by running ``tar --create --gzip``, and restores it with ``tar --extract
--gzip``; GNU tar runs ``sh -c gzip``: three dynamically linked programs per mount, 4-6 ms
each on the 2-core VM here, ~25 ms of every frozen window and ~30 ms of the 75 ms CRIU
spends in each restore (its restore.log), for six trees of a few kilobytes.
``scripts/native/criu_tar.c`` is a static program that writes the same archive in-process
(GNU format, byte for byte what GNU tar writes; zlib level 1) in ~0.7 ms, and hands every
command line or tree it does not write exactly so (sockets, hard links, sparse files, long
names) to the real tar, before writing a byte. ``criu_untar.c``, its restore side, makes
what GNU tar makes of such an archive (entries, modes, numeric owners, mtimes; atime: when
it started, as GNU tar), after reading it whole once; any other archive (GNU tar's hard
links, long names, sparse files, owner names, a second gzip member), a target that is not
empty or a stdin that cannot be re-read goes to the real tar from the archive's start.

``install()`` (``bash scripts/setup.sh``, or ``python3 belayer_env/host/fast_tar.py``)
builds it into ``HELPER`` only if its archive of a sample tree is byte-identical to the host
tar's and its extraction of that archive gives the tree the host tar's gives; otherwise it
removes any old build and says why. Dumps put ``DIR`` first in the PATH of runc and CRIU
(``runtime.dump``; ``BELAYER_CRIU_FAST_TAR=0`` turns that off), where it shadows nothing but
``tar``. Restores run under Docker (dockerd -> containerd -> runc -> CRIU), with dockerd's
PATH: set-up starts dockerd with ``DIR`` first in it (``dockerd_uses_it``); a dockerd
started otherwise restores with GNU tar, as before, and so does every restore while
``RESTORE_OFF`` exists.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from belayer_env.host.native import NATIVE, BuildError, compile_static

DIR = Path("/usr/local/libexec/belayer-criu-tar")
HELPER = DIR / "tar"
RESTORE_OFF = DIR / "restore-off"
"""While this file exists the helper hands every extraction to GNU tar (dumps: ``runtime.FAST_TAR``)."""
SOURCES = (NATIVE / "criu_tar.c", NATIVE / "criu_untar.c")
CRIU_ARGS = ("--create", "--gzip", "--no-unquote", "--no-wildcards", "--one-file-system", "--check-links",
             "--preserve-permissions", "--sparse", "--numeric-owner", "--directory", "/proc/self/fd/0", ".")
"""What CRIU 4.x runs (``tmpfs_dump`` in criu/filesystems.c), the mount's root on stdin."""
EXTRACT_ARGS = ("--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory")
"""What CRIU 4.x runs to restore one (``tmpfs_restore``), then the mount; the image on stdin."""
EXTRACTED = "belayer-criu-tar: extracted "
"""How the helper's in-process extraction starts its line in CRIU's restore log."""


def installed() -> bool:
    return os.access(HELPER, os.X_OK)


def dockerd_uses_it() -> bool | None:
    """Whether the local dockerd (whose PATH CRIU's restores inherit) finds ``DIR`` first;
    None when no dockerd runs here (a remote daemon) or its environment is unreadable."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "comm").read_text().strip() != "dockerd":
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        path = next((e[5:].decode(errors="replace") for e in env if e.startswith(b"PATH=")), "")
        return path.split(":")[0] == str(DIR)
    return None


def dump_path(path: str | None) -> str:
    """``path`` (a PATH value) with the helper's directory first."""
    return f"{DIR}:{path or os.defpath}"


def real_tar() -> str:
    found = shutil.which("tar", path=os.environ.get("PATH", os.defpath).replace(f"{DIR}:", ""))
    if not found:
        raise BuildError("no tar on PATH")
    return os.path.realpath(found)


def build(out: Path, tar: str | None = None, sources: tuple[Path, ...] = SOURCES, libc: str = "auto") -> str:
    """Compile the helper (static, zlib) into ``out``; it hands over to ``tar``. Returns the C
    library used (``native.compile_static``)."""
    return compile_static(out, sources, defines=[f'REAL_TAR="{tar or real_tar()}"'], libs=["z"], libc=libc)


def archive(program: str, root: Path, args: tuple[str, ...] = CRIU_ARGS) -> bytes:
    """What ``program`` writes for ``root`` when run the way CRIU runs tar (gzip'd bytes)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        r = subprocess.run(["tar", *args], executable=program, stdin=fd, capture_output=True, cwd="/")
    finally:
        os.close(fd)
    if r.returncode != 0:
        raise BuildError(f"{program} failed ({r.returncode}): {r.stderr.decode(errors='replace').strip()[-300:]}")
    return r.stdout


def extract(program: str, gz: bytes, dest: Path) -> str:
    """Run ``program`` the way CRIU's restore runs tar: ``gz`` on stdin (a file, as CRIU's
    image is), ``dest`` the (empty) mount to fill; what it logged (CRIU's log gets stdout)."""
    with tempfile.TemporaryFile() as f:
        f.write(gz)
        f.seek(0)
        r = subprocess.run(["tar", *EXTRACT_ARGS, str(dest)], executable=program, stdin=f, capture_output=True,
                           cwd="/")
    if r.returncode != 0:
        raise BuildError(f"{program} failed to extract ({r.returncode}): "
                         f"{r.stderr.decode(errors='replace').strip()[-300:]}")
    return r.stdout.decode(errors="replace")


def extracted_in_process(log: str) -> bool:
    return log.startswith(EXTRACTED)


def restore_log(docker_root: str | Path, container_id: str) -> Path:
    """CRIU's log of the restore that started ``container_id`` (containerd keeps it while the
    container exists): one ``EXTRACTED`` line per tmpfs the helper filled."""
    return (Path(docker_root) / "containerd" / "daemon" / "io.containerd.runtime.v2.task" / "moby" / container_id
            / "restore.log")


def tree_state(root: Path) -> dict[str, tuple]:
    """Everything a restore must reproduce of a tree: per path its type, mode, owner, mtime,
    device, size, link target and content hash (not atime: tar sets it to its start)."""
    state = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = p.lstat()
        extra = (os.readlink(p),) if p.is_symlink() else \
            (hashlib.sha256(p.read_bytes()).hexdigest(),) if stat.S_ISREG(st.st_mode) else ()
        state[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_rdev,
                                           st.st_size if not stat.S_ISDIR(st.st_mode) else 0, *extra)
    return state


def took_fast_path(gz: bytes) -> bool:
    """zlib marks level 1 in the gzip header's XFL byte (4); GNU gzip's default level leaves 0."""
    return len(gz) > 9 and gz[:2] == b"\x1f\x8b" and gz[8] == 4


def make_sample(root: Path) -> None:
    """A tree of every kind the helper writes itself (devices only where mknod is allowed)."""
    (root / "d" / "e").mkdir(parents=True)
    (root / "sticky").mkdir(mode=0o1777)
    os.chmod(root / "sticky", 0o1777)
    (root / "d" / "f").write_bytes(b"belayer\n")
    (root / "d" / "e" / "g").write_bytes(bytes(range(256)) * 9)
    (root / "empty").write_bytes(b"")
    (root / "block").write_bytes(b"\0" * 512)
    os.chmod(root / "block", 0o4750)
    os.symlink("../d/f", root / "d" / "e" / "link")
    os.mkfifo(root / "fifo", 0o640)
    with contextlib.suppress(PermissionError):
        os.mknod(root / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    with contextlib.suppress(PermissionError):
        os.chown(root / "d" / "f", 1000, 65534)
    for i, p in enumerate(sorted(root.rglob("*"), reverse=True)):
        os.utime(p, (1_000_000_000 + i, 1_000_000_000 + i), follow_symlinks=False)


def check(helper: Path = HELPER, tar: str | None = None) -> str:
    """Why ``helper`` must not be used, or "" when it writes what ``tar`` writes and takes
    its own path for the sample tree, and hands a tree it does not write to ``tar``."""
    tar = tar or real_tar()
    with tempfile.TemporaryDirectory(prefix="belayer-fast-tar-") as tmp:
        root = Path(tmp) / "tree"
        root.mkdir()
        make_sample(root)
        ours = archive(str(helper), root)
        if not took_fast_path(ours):
            return "it handed the sample tree to the real tar"
        if gzip.decompress(ours) != gzip.decompress(archive(tar, root)):
            return f"its archive of a sample tree differs from {tar}'s"
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.bind(str(root / "sock"))  # a socket: the real tar's business
            handed, theirs = archive(str(helper), root), archive(tar, root)
        finally:
            sock.close()
        if gzip.decompress(handed) != gzip.decompress(theirs):
            return f"a tree it hands to {tar} came out different"
        (root / "sock").unlink()
        return _check_extract(helper, tar, root, ours, Path(tmp))


def _check_extract(helper: Path, tar: str, root: Path, gz: bytes, tmp: Path) -> str:
    """Why its extraction must not be used, or "": the sample archive comes out as ``tar``
    makes it, in-process, and an archive it does not extract (a hard link) goes to ``tar``.
    Switched off (``RESTORE_OFF`` beside it), it hands every archive over: nothing to check."""
    if (helper.parent / RESTORE_OFF.name).exists():
        return ""
    mine, theirs = tmp / "mine", tmp / "theirs"
    for d in (mine, theirs):
        d.mkdir()
    if not extracted_in_process(extract(str(helper), gz, mine)):
        return "it handed the sample archive to the real tar"
    extract(tar, gz, theirs)
    if tree_state(mine) != tree_state(theirs):
        return f"its extraction of a sample archive differs from {tar}'s"
    os.link(root / "d" / "f", root / "d" / "f2")
    linked = archive(tar, root)
    for d in (mine, theirs):
        shutil.rmtree(d)
        d.mkdir()
    if extracted_in_process(extract(str(helper), linked, mine)):
        return "it extracted a hard link itself"
    extract(tar, linked, theirs)
    if tree_state(mine) != tree_state(theirs):
        return f"an archive it hands to {tar} came out different"
    return ""


def install() -> str:
    """Build, check against the host's tar, install; say what happened."""
    tar = real_tar()
    DIR.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=DIR, prefix=".tar.")
    os.close(fd)
    try:
        libc = build(Path(tmp), tar)
        os.chmod(tmp, 0o755)
        why = check(Path(tmp), tar)
        if why and libc == "musl":  # the glibc build, as before musl
            libc = build(Path(tmp), tar, libc="glibc")
            os.chmod(tmp, 0o755)
            why = check(Path(tmp), tar)
        if why:
            HELPER.unlink(missing_ok=True)
            return f"not installed ({why}): dumps run {tar}"
        os.replace(tmp, HELPER)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return f"{HELPER} ({libc}): writes what {tar} writes, in-process (hands anything else to it)"


if __name__ == "__main__":  # `python3 belayer_env/host/fast_tar.py` (scripts/setup.sh)
    try:
        print(install())
    except (BuildError, OSError) as e:
        print(f"fast tar: {e}", file=sys.stderr)
        sys.exit(2)
