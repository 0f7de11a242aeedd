"""A layer with paths past PATH_MAX is installed and copied whole (``layer.install``,
``layer.copy_tree``): GNU tar archives such a tree but cannot extract it; what it could not
make is made through directory fds (``store/long_paths.py``). Real GNU tar, real files."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

from belayer_env.store import layer

DEEP = "d" + "0" * 100


def _deep_tree(root: Path) -> None:
    """50 nested 101-character directories; at the bottom every kind of entry a layer holds."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.mknod("wh", 0o600 | stat.S_IFCHR, os.makedev(0, 0), dir_fd=fd)  # a whiteout
        for _ in range(50):
            os.mkdir(DEEP, 0o755, dir_fd=fd)
            new = os.open(DEEP, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = new
        os.setxattr(fd, "trusted.overlay.opaque", b"y")
        out = os.open("f", os.O_WRONLY | os.O_CREAT, 0o640, dir_fd=fd)
        os.write(out, b"deep\n")
        os.fchown(out, 123, 456)
        os.setxattr(out, "user.note", b"\xff\x00bin")
        os.close(out)
        os.link("f", "g", src_dir_fd=fd, dst_dir_fd=fd)
        os.link("f", str(root / "short-link"), src_dir_fd=fd)  # a short name for a long file
        os.symlink("f", "s", dir_fd=fd)
        os.mkfifo("p", 0o600, dir_fd=fd)
        os.mknod("wh", 0o600 | stat.S_IFCHR, os.makedev(0, 0), dir_fd=fd)
        sparse = os.open("sparse", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.pwrite(sparse, b"x", 10 << 20)
        os.close(sparse)
    finally:
        os.close(fd)


def _state(root: Path) -> tuple[str, str]:
    """Every entry's metadata (find walks by fds) and a digest of contents + xattrs (a tar of
    the tree in name order, without atime and ctime)."""
    meta = subprocess.run(["find", ".", "-printf", "%p %y %m %U %G %s %T@ %l %n\\n"], cwd=root,
                          capture_output=True, text=True, check=True).stdout
    tar = subprocess.run(["tar", "--create", "--sort=name", "--file=-", "--format=posix", "--xattrs",
                          "--xattrs-include=*", "--numeric-owner", "--pax-option=delete=atime,delete=ctime",
                          "-C", str(root), "."], capture_output=True, check=True).stdout
    return "\n".join(sorted(meta.splitlines())), hashlib.sha256(tar).hexdigest()


def test_install_and_copy_keep_a_tree_past_path_max(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _deep_tree(src)
    archive = tmp_path / "layer.tar"
    subprocess.run(["tar", "--create", "--sparse", f"--file={archive}", f"--directory={src}", *layer.TAR_OPTS, "."],
                   check=True)
    data = archive.read_bytes()
    meta = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    expected = _state(src)

    installed = tmp_path / "installed"
    installed.mkdir()
    layer.install(archive, installed, meta)
    assert _state(installed) == expected

    copied = tmp_path / "copied"
    copied.mkdir()
    layer.copy_tree(src, copied)
    assert _state(copied) == expected
    assert os.stat(copied / "short-link").st_nlink == 3  # the short and both long names: one file
