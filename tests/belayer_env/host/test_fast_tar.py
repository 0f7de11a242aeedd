"""``fast_tar``: the helper CRIU runs as ``tar`` to dump a tmpfs writes, byte for byte, the
archive GNU tar writes, hands every tree it does not write exactly so to GNU tar; to restore
one it makes what GNU tar makes of the archive and hands every other archive (and every
escape attempt) to GNU tar; a sandbox restored from its archives, through Docker, has the
same tmpfs contents and was filled by the helper."""

from __future__ import annotations

import gzip
import hashlib
import os
import random
import shutil
import socket
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.criu import runtime
from belayer_env.host import fast_tar
from belayer_env.restore.restore import full_restore

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc: set-up builds the helper")


@pytest.fixture(scope="module")
def helper(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fast-tar") / "tar"
    fast_tar.build(out)
    return out


@pytest.fixture
def tmpfs(tmp_path):
    """A fresh tmpfs, as CRIU sees the mounts it dumps (root only)."""
    root = tmp_path / "tmpfs"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=64m", "belayer-test", str(root)], check=True)
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def test_the_helper_writes_what_gnu_tar_writes_and_takes_its_own_path(helper, tmpfs):
    fast_tar.make_sample(tmpfs)
    (tmpfs / "big").write_bytes(os.urandom(300_000))  # several deflate blocks
    (tmpfs / "mnt").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "inner", str(tmpfs / "mnt")], check=True)
    try:
        (tmpfs / "mnt" / "below").write_text("on another file system: not archived\n")
        ours = fast_tar.archive(str(helper), tmpfs)
        theirs = fast_tar.archive(fast_tar.real_tar(), tmpfs)
    finally:
        subprocess.run(["umount", str(tmpfs / "mnt")], check=True)
    assert fast_tar.took_fast_path(ours) and not fast_tar.took_fast_path(theirs)
    assert gzip.decompress(ours) == gzip.decompress(theirs)
    assert b"./mnt/below" not in gzip.decompress(ours)  # --one-file-system: the mount point alone


NAME_BYTES = [b"a", b"Z", b" ", b"\n", b"\xc3\xa9", b"-", b".", b"\\", b"*", b"?", b"\x01"]


def _random_tree(root: Path, rnd: random.Random) -> None:
    """Names with spaces, newlines, UTF-8 and glob characters, every mode bit, owners,
    mtimes, device numbers: the kinds the helper writes itself, in random shapes."""
    dirs = [bytes(root)]
    for _ in range(rnd.randint(0, 40)):
        name = b"".join(rnd.choice(NAME_BYTES) for _ in range(rnd.randint(1, 12)))
        path = rnd.choice(dirs) + b"/" + name
        if name in (b".", b"..") or os.path.lexists(path):
            continue
        kind = rnd.random()
        if kind < 0.3:
            os.mkdir(path, rnd.choice([0o755, 0o700, 0o1777, 0o555]))
            dirs.append(path)
        elif kind < 0.75:
            with open(path, "wb") as f:
                f.write(rnd.randbytes(rnd.choice([0, 1, 511, 512, 513, 4096, 70000])))
            os.chmod(path, rnd.choice([0o644, 0o600, 0o4755, 0o2711, 0o000]))
        elif kind < 0.85:
            os.symlink(b"".join(rnd.choice(NAME_BYTES) for _ in range(rnd.randint(1, 30))), path)
        elif kind < 0.92:
            os.mkfifo(path, 0o600)
        else:
            os.mknod(path, 0o620 | stat.S_IFCHR, os.makedev(rnd.randint(0, 300), rnd.randint(0, 300)))
        if rnd.random() < 0.3:
            os.lchown(path, rnd.randint(0, 70000), rnd.randint(0, 70000))
        if rnd.random() < 0.5:
            os.utime(path, (rnd.randint(0, 2**32),) * 2, follow_symlinks=False)


def _random_trees(tmpfs: Path, seed: int, n: int = 25):
    """``n`` random trees (``_random_tree``) under ``tmpfs``, one at a time: (index, root)."""
    rnd = random.Random(seed)
    for i in range(n):
        root = tmpfs / f"t{i}"
        root.mkdir()
        _random_tree(root, rnd)
        yield i, root


def test_random_trees_come_out_as_gnu_tar_writes_them(helper, tmpfs):
    for i, root in _random_trees(tmpfs, 15):
        ours = fast_tar.archive(str(helper), root)
        assert fast_tar.took_fast_path(ours), f"tree {i} went to GNU tar"
        assert gzip.decompress(ours) == gzip.decompress(fast_tar.archive(fast_tar.real_tar(), root)), f"tree {i}"


def _hardlink(root: Path) -> None:
    os.link(root / "d" / "f", root / "d" / "f2")


def _socket(root: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(root / "sock"))
    s.close()


def _sparse(root: Path) -> None:
    with open(root / "sparse", "wb") as f:
        f.truncate(8 << 20)
        f.write(b"head")


def _long_name(root: Path) -> None:
    (root / ("x" * 60) / ("y" * 45)).mkdir(parents=True)


def _many_entries(root: Path) -> None:
    many = root / "many"
    many.mkdir()
    for i in range(100_001):  # the helper keeps every entry in memory: past its cap, GNU tar streams
        os.mknod(many / str(i), 0o644 | stat.S_IFREG)


@pytest.mark.parametrize("unusual", [_hardlink, _socket, _sparse, _long_name, _many_entries],
                         ids=lambda f: f.__name__[1:])
def test_a_tree_it_does_not_write_itself_goes_to_gnu_tar_unchanged(helper, tmpfs, unusual):
    fast_tar.make_sample(tmpfs)
    unusual(tmpfs)
    ours = fast_tar.archive(str(helper), tmpfs)
    assert not fast_tar.took_fast_path(ours), "the helper wrote a tree it should have handed over"
    assert gzip.decompress(ours) == gzip.decompress(fast_tar.archive(fast_tar.real_tar(), tmpfs))


def test_any_other_command_line_goes_to_gnu_tar(helper, tmp_path):
    (tmp_path / "f").write_text("x")
    listing = subprocess.run(["tar", "--create", "--file", "-", "-C", str(tmp_path), "f"], executable=str(helper),
                             capture_output=True, check=True).stdout
    out = subprocess.run(["tar", "--list", "--file", "-"], input=listing, capture_output=True, check=True).stdout
    assert out == b"f\n"


def test_check_accepts_the_helper_and_refuses_a_tar_that_writes_otherwise(helper, tmp_path):
    assert fast_tar.check(helper) == ""
    fake = tmp_path / "other-tar"  # a tar that writes a different (valid) archive
    fake.write_text(f"#!/bin/sh\nexec {fast_tar.real_tar()} --create --gzip --mtime=@0 --directory /proc/self/fd/0 .\n")
    fake.chmod(0o755)
    assert "differs" in fast_tar.check(helper, tar=str(fake))


def _outcome(program: str, gz: bytes, dest: Path, stdin_pipe: bool = False) -> tuple[int, bool, dict]:
    """Exit status, whether it extracted in-process, and the tree it left in ``dest``."""
    args = ["tar", *fast_tar.EXTRACT_ARGS, str(dest)]
    if stdin_pipe:
        r = subprocess.run(args, executable=program, input=gz, capture_output=True, cwd="/")
    else:
        with tempfile.TemporaryFile() as f:
            f.write(gz)
            f.seek(0)
            r = subprocess.run(args, executable=program, stdin=f, capture_output=True, cwd="/")
    return r.returncode, fast_tar.extracted_in_process(r.stdout.decode(errors="replace")), fast_tar.tree_state(dest)


def _both(helper: Path, gz: bytes, base: Path, prepare=None, stdin_pipe: bool = False):
    """The helper's and GNU tar's outcomes for ``gz``, each into a fresh dir under ``base``."""
    out = []
    for who, program in (("mine", str(helper)), ("theirs", fast_tar.real_tar())):
        dest = base / who
        dest.mkdir()
        if prepare:
            prepare(dest)
        out.append(_outcome(program, gz, dest, stdin_pipe))
    return out


def test_random_archives_extract_as_gnu_tar_extracts_them(helper, tmpfs):
    for i, root in _random_trees(tmpfs, 16):
        gz = fast_tar.archive(str(helper), root)
        work = tmpfs / f"x{i}"
        work.mkdir()
        (rc, fast, tree), (their_rc, _, their_tree) = _both(helper, gz, work)
        assert rc == their_rc == 0 and fast, f"tree {i}: {rc} {their_rc} {fast}"
        assert tree == their_tree, f"tree {i}"
        source = {k: (*v[:3], v[3] // 10**9 * 10**9, *v[4:]) for k, v in fast_tar.tree_state(root).items()}
        assert tree == source, f"tree {i}: not the tree archived (mtimes in whole seconds: GNU's format)"


def _rewrite(gz: bytes, old: str, new: str) -> bytes:
    """The archive with member ``old`` renamed ``new`` (its header's checksum fixed)."""
    raw = bytearray(gzip.decompress(gz))
    for off in range(0, len(raw), 512):
        if raw[off:off + 100].rstrip(b"\0") == old.encode():
            raw[off:off + 100] = new.encode().ljust(100, b"\0")
            raw[off + 148:off + 156] = b" " * 8
            raw[off + 148:off + 155] = b"%06o\0" % sum(raw[off:off + 512])
            return gzip.compress(bytes(raw))
    raise AssertionError(f"no member {old}")


def _no_dir_mtimes(state: dict) -> dict:
    return {k: (*v[:3], None if stat.S_ISDIR(v[0]) else v[3], *v[4:]) for k, v in state.items()}


def _gnu_archive_of(unusual):
    def make(helper: Path, root: Path) -> bytes:
        fast_tar.make_sample(root)
        unusual(root)
        return fast_tar.archive(fast_tar.real_tar(), root)
    return make


def _sample(edit=None):
    def make(helper: Path, root: Path) -> bytes:
        fast_tar.make_sample(root)
        gz = fast_tar.archive(str(helper), root)
        return edit(gz) if edit else gz
    return make


ODD_ARCHIVES = {
    "hard link": _gnu_archive_of(_hardlink),
    "long name": _gnu_archive_of(_long_name),
    "sparse file": _gnu_archive_of(_sparse),
    "second gzip member": _sample(lambda gz: gz + gzip.compress(b"\0" * 1024)),
    "trailing bytes": _sample(lambda gz: gz + b"junk"),
    "truncated": _sample(lambda gz: gz[:len(gz) // 2]),
    "bad checksum": _sample(lambda gz: gzip.compress(gzip.decompress(gz)[:600] + b"X" + gzip.decompress(gz)[601:])),
    "dot-dot escape": _sample(lambda gz: _rewrite(gz, "./d/f", "./../escaped")),
    "through a symlink": _sample(lambda gz: _rewrite(gz, "./d/e/g", "./d/e/link/g")),
    "name twice": _sample(lambda gz: _rewrite(gz, "./empty", "./block")),
    "absolute name": _sample(lambda gz: _rewrite(gz, "./empty", "/tmp/belayer-absolute")),
}


@pytest.mark.parametrize("case", list(ODD_ARCHIVES))
def test_an_archive_it_does_not_extract_itself_goes_to_gnu_tar(helper, tmpfs, case):
    src = tmpfs / "src"
    src.mkdir()
    gz = ODD_ARCHIVES[case](helper, src)
    (tmpfs / "work").mkdir()
    (rc, fast, tree), (their_rc, _, their_tree) = _both(helper, gz, tmpfs / "work")
    assert not fast, f"{case}: extracted in-process"
    # (directories GNU tar makes on its own way, as for "/tmp/..." -> "tmp/", get the time of the run)
    assert (rc, _no_dir_mtimes(tree)) == (their_rc, _no_dir_mtimes(their_tree)), case
    assert sorted(p.name for p in (tmpfs / "work").iterdir()) == ["mine", "theirs"], "something landed outside"
    assert not os.path.lexists("/tmp/belayer-absolute")


def test_a_target_not_empty_or_a_pipe_goes_to_gnu_tar(helper, tmpfs):
    src = tmpfs / "src"
    src.mkdir()
    gz = _sample()(helper, src)
    for name, kw in (("not-empty", {"prepare": lambda d: (d / "empty").write_text("there first\n")}),
                     ("pipe", {"stdin_pipe": True})):
        (tmpfs / name).mkdir()
        (rc, fast, tree), (their_rc, _, their_tree) = _both(helper, gz, tmpfs / name, **kw)
        assert not fast and (rc, tree) == (their_rc, their_tree), name


def test_check_refuses_a_tar_that_extracts_otherwise(helper, tmp_path):
    fake = tmp_path / "other-tar"  # writes GNU tar's archive, extracts with the umask applied
    fake.write_text(f'#!/bin/sh\n[ "$1" = --extract ] && exec {fast_tar.real_tar()} "$@" --no-same-permissions\n'
                    f'exec {fast_tar.real_tar()} "$@"\n')
    fake.chmod(0o755)
    assert "extraction of a sample archive differs" in fast_tar.check(helper, tar=str(fake))


def test_a_bad_switch_value_is_a_usage_error_naming_it():
    r = subprocess.run(["python3", "-c", "import belayer_env.criu.runtime"], capture_output=True, text=True,
                       env={**os.environ, "BELAYER_CRIU_FAST_TAR": "yes"})
    assert r.returncode != 0 and "BELAYER_CRIU_FAST_TAR must be 0 or 1, got 'yes'" in r.stderr


TMPFS_STATE = r"""set -e
cd /
for d in /dev /dev/shm; do
  # mtimes of the tmpfs entries (CRIU's tar restores them); /dev/pts and /dev/mqueue are other mounts
  find "$d" -xdev \( -fstype tmpfs -printf '%p %y %m %U %G %s %l %T@\n' \) -o -printf '%p %y %m %U %G %s %l\n' |
    sed 's/\.[0-9]*$//' | sort
done
find /dev/shm -xdev -type f -exec sha256sum {} + | sort
"""


def _tmpfs_state(sb) -> str:
    r = sb.execute(TMPFS_STATE)
    assert r["returncode"] == 0, r["output"]
    return r["output"]


def test_a_sandbox_restored_from_its_archives_has_the_same_tmpfs_contents(make_sandbox, ck_store, docker_client,
                                                                        monkeypatch):
    if not fast_tar.installed():
        pytest.skip(f"{fast_tar.HELPER} not installed (bash scripts/setup.sh)")
    sb = make_sandbox()
    r = sb.execute("mkdir -p /dev/shm/a/b && head -c 200000 /dev/urandom > /dev/shm/a/b/data && "
                   "chmod 600 /dev/shm/a/b/data && chown 1000:100 /dev/shm/a && ln -s a/b/data /dev/shm/link && "
                   "mkfifo /dev/shm/fifo && : > /dev/shm/empty && chmod 1777 /dev/shm/a/b")
    assert r["returncode"] == 0, r["output"]
    before = _tmpfs_state(sb)
    images = {}
    for on in (False, True):
        monkeypatch.setattr(runtime, "FAST_TAR", on)
        ck = full_checkpoint(sb, ck_store)
        tars = sorted((Path(ck.path) / "runtime").glob("tmpfs-dev-*.tar.gz.img"))
        assert len(tars) >= 4, "expected Docker's /dev, /dev/shm and the masked paths among the tmpfs dumps"
        assert all(fast_tar.took_fast_path(p.read_bytes()) == on for p in tars), [p.name for p in tars]
        images[on] = {p.name: hashlib.sha256(gzip.decompress(p.read_bytes())).hexdigest() for p in tars}
    # the same mounts, archived by GNU tar and by the helper: the same tar streams, bar the one of
    # /run/belayer (the sandbox stages command output there, between the two captures)
    assert images[True].keys() == images[False].keys()
    assert sum(images[True][k] != images[False][k] for k in images[True]) <= 1
    restored = full_restore(ck, client=docker_client)
    assert _tmpfs_state(restored) == before  # types, modes, owners, sizes, targets, mtimes, contents
    if fast_tar.dockerd_uses_it() is False:
        pytest.fail(f"dockerd's PATH does not start with {fast_tar.DIR}: restores run GNU tar "
                    "(bash scripts/setup.sh restarts a dockerd that holds no container with it)")
    log = fast_tar.restore_log(docker_client.info()["DockerRootDir"], restored.container_id).read_text(errors="replace")
    assert log.count(fast_tar.EXTRACTED) == len(images[True]), "CRIU's restore ran GNU tar for some tmpfs"
