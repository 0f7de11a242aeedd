"""``mounting``: loop and tmpfs mounts by system call behave as ``mount(8)``'s did.

The properties: a loop-mounted file system holds what is written to it across mounts and
outlives its unlinked image file; its loop device is gone once it is unmounted, and never
left bound when the mount fails; concurrent mounts each get a device of their own; a tmpfs
gets its options; errors name what was being mounted.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import subprocess
from pathlib import Path

import pytest

from belayer_core.procfs import mounts
from belayer_env.sandbox import disk, mounting
from belayer_env.store import in_memory
from tests.conftest import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(mounting.LOOP_CONTROL),
                                reason="mounts need root and loop devices")


def _ext4_image(path: Path, size: int = 16 << 20) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.ext4", *disk.MKFS_OPTS, str(path)], check=True, capture_output=True)
    return path


def _mount_of(target: Path) -> tuple[str, str] | None:
    """(source, fstype) of the topmost mount exactly at ``target`` (None: not a mount point)."""
    at = [m for m in mounts() if m.target == str(target.resolve())]
    return (at[-1].source, at[-1].fstype) if at else None


def _wait_unbound(image: Path) -> None:
    wait_until(lambda: not mounting.loop_devices_of(image), 10, f"the loop device of {image} to detach")


def test_a_loop_mount_keeps_its_data_and_its_device_goes_with_the_unmount(tmp_path):
    image, target = _ext4_image(tmp_path / "fs.img"), tmp_path / "mnt"
    target.mkdir()
    mounting.loop_mount(image, target)
    try:
        source, fstype = _mount_of(target)
        assert fstype == "ext4" and mounting.loop_devices_of(image) == [source]
        (target / "kept").write_text("kept\n")
    finally:
        mounting.umount(target)
    assert _mount_of(target) is None
    _wait_unbound(image)
    mounting.loop_mount(image, target)  # the file system, not the mount, held the write
    try:
        assert (target / "kept").read_text() == "kept\n"
    finally:
        mounting.umount(target)
    _wait_unbound(image)


def test_a_kernel_without_loop_configure_binds_in_two_calls_with_autoclear(tmp_path, monkeypatch):
    """Before Linux 5.8 there is no ``LOOP_CONFIGURE``: an ioctl this kernel does not know
    stands in for it, so the ``LOOP_SET_FD`` + ``LOOP_SET_STATUS64`` path runs for real."""
    monkeypatch.setattr(mounting, "_LOOP_CONFIGURE", 0x4CFF)
    image, target = _ext4_image(tmp_path / "fs.img"), tmp_path / "mnt"
    target.mkdir()
    mounting.loop_mount(image, target)
    try:
        [device] = mounting.loop_devices_of(image)
        assert _mount_of(target) == (device, "ext4")
        assert Path(f"/sys/block/{Path(device).name}/loop/autoclear").read_text().strip() == "1"
    finally:
        mounting.umount(target)
    _wait_unbound(image)


def test_an_unlinked_image_lives_as_long_as_its_mount(tmp_path):
    image, target = _ext4_image(tmp_path / "fs.img"), tmp_path / "mnt"
    target.mkdir()
    mounting.loop_mount(image, target)
    try:
        image.unlink()  # what ``disk.limit_layer`` does once mounted
        (target / "big").write_bytes(os.urandom(1 << 20))
        assert (target / "big").stat().st_size == 1 << 20
    finally:
        mounting.umount(target)
    _wait_unbound(image)  # the kernel lists it as "<path> (deleted)"


def test_a_failed_loop_mount_names_the_target_and_leaves_no_device_bound(tmp_path):
    not_a_file_system, target = tmp_path / "zeros.img", tmp_path / "mnt"
    target.mkdir()
    with open(not_a_file_system, "wb") as f:
        f.truncate(4 << 20)
    with pytest.raises(OSError, match=f"mount ext4 /dev/loop[0-9]+ on {target}") as failure:
        mounting.loop_mount(not_a_file_system, target)
    assert failure.value.errno == errno.EINVAL and _mount_of(target) is None
    _wait_unbound(not_a_file_system)
    with pytest.raises(FileNotFoundError):
        mounting.loop_mount(tmp_path / "missing.img", target)


def test_concurrent_loop_mounts_each_get_a_device_of_their_own(tmp_path):
    pairs = []
    for i in range(6):
        (tmp_path / f"mnt{i}").mkdir()
        pairs.append((_ext4_image(tmp_path / f"fs{i}.img", 8 << 20), tmp_path / f"mnt{i}"))
    with concurrent.futures.ThreadPoolExecutor(len(pairs)) as pool:
        list(pool.map(lambda p: mounting.loop_mount(*p), pairs))
    try:
        sources = [_mount_of(target)[0] for _, target in pairs]
        assert len(set(sources)) == len(pairs), sources
        for (image, _), source in zip(pairs, sources, strict=True):
            assert mounting.loop_devices_of(image) == [source]
    finally:
        for _, target in pairs:
            mounting.umount(target)
    for image, _ in pairs:
        _wait_unbound(image)


def test_a_tmpfs_gets_its_options_and_a_busy_one_unmounts_lazily(tmp_path):
    target = tmp_path / "tmpfs"
    target.mkdir()
    assert in_memory.try_mount_tmpfs(target, 1 << 20, source="belayer-test", mode="0700")
    try:
        assert _mount_of(target) == ("belayer-test", "tmpfs")
        assert target.stat().st_mode & 0o777 == 0o700
        st = os.statvfs(target)
        assert st.f_blocks * st.f_frsize == 1 << 20
        busy = open(target / "open", "w")  # noqa: SIM115 - held open across the unmount
        with pytest.raises(OSError, match=f"umount {target}") as failure:
            mounting.umount(target)
        assert failure.value.errno == errno.EBUSY
        in_memory.umount(target)  # falls back to a lazy unmount
        assert _mount_of(target) is None
        busy.write("still writable\n")
        busy.close()
    finally:
        in_memory.umount(target)
    with pytest.raises(OSError, match=f"mount tmpfs belayer-test on {target} -o size=1m,nonsense=1"):
        mounting.mount("belayer-test", target, "tmpfs", "size=1m,nonsense=1")
    assert _mount_of(target) is None
