"""Mounts by system call, not by ``mount(8)``.

``mount -o loop`` costs 8-25 ms here (an exec, libmount, a blkid probe of the source, a
loop device set up by ``losetup``'s code) around a ~1 ms ``mount(2)``; a ``mount -t
tmpfs`` costs the same exec. Those run on a restore's critical path (the pre-staged layer
file system mounted into the new container, the unpacks into tmpfs) and once per
created sandbox (its disk cap), on a 2-core host beside CRIU. Here they are the calls
themselves: ``loop_mount`` binds a free loop device with autoclear (it detaches itself
when its file system is unmounted, as with ``mount -o loop``; and if the mount fails,
when this module closes it), ``mount`` and ``umount`` are ``mount(2)`` and
``umount2(2)``. Errors are ``OSError`` with the errno and what was being mounted.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Iterator
from pathlib import Path

LOOP_CONTROL = "/dev/loop-control"
_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_SET_FD = 0x4C00
_LOOP_CLR_FD = 0x4C01
_LOOP_SET_STATUS64 = 0x4C04
_LOOP_CONFIGURE = 0x4C0A  # Linux 5.8+: fd and status in one call
_LO_FLAGS_AUTOCLEAR = 4
_MNT_DETACH = 2
_INFO64 = struct.Struct("=5Q4I64s64s32s2Q")  # struct loop_info64
_CONFIG = struct.Struct(f"=2I{_INFO64.size}s8Q")  # struct loop_config
_BIND_ATTEMPTS = 32  # another process may take the free device first: ask again

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def mount(source: str | Path, target: str | Path, fstype: str, options: str = "") -> None:
    """``mount -t fstype -o options source target`` (``options``: the file system's own, as
    ``size=..,mode=..`` for tmpfs; no mount flags)."""
    if _libc.mount(os.fsencode(source), os.fsencode(target), fstype.encode(), 0, options.encode() or None) != 0:
        raise _error(f"mount {fstype} {source} on {target}" + (f" -o {options}" if options else ""))


def umount(target: str | Path, *, lazy: bool = False) -> None:
    """Unmount ``target``; ``lazy``: detach it now, the file system goes with its last user."""
    if _libc.umount2(os.fsencode(target), _MNT_DETACH if lazy else 0) != 0:
        raise _error(f"umount {target}")


def loop_mount(image: str | Path, target: str | Path, fstype: str = "ext4") -> None:
    """Mount the file system in file ``image`` at ``target`` through a free loop device that
    detaches itself at the unmount. ``image`` may be unlinked once this returns."""
    with _bound_loop_device(image) as device:
        mount(device, target, fstype)


def loop_devices_of(image: str | Path) -> list[str]:
    """The loop devices bound to ``image`` (by its path when bound): what a mount holds, or leaked."""
    wanted = os.path.realpath(image)
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if backing.read_text().strip().removesuffix(" (deleted)") == wanted:
                found.append("/dev/" + backing.parent.parent.name)
    return found


@contextlib.contextmanager
def _bound_loop_device(image: str | Path) -> Iterator[str]:
    """A loop device bound to ``image`` with autoclear, open while the body runs: closing it
    unbinds it unless the body mounted it (then it goes with that mount)."""
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        control = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(_BIND_ATTEMPTS):
                index = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
                device = f"/dev/loop{index}"
                loop = os.open(device, os.O_RDWR | os.O_CLOEXEC)
                try:
                    if _bind(loop, backing, os.fsencode(os.path.realpath(image))):
                        os.close(control)
                        control = -1
                        yield device
                        return
                finally:
                    os.close(loop)
            raise OSError(errno.EBUSY, f"no free loop device for {image} after {_BIND_ATTEMPTS} attempts")
        finally:
            if control >= 0:
                os.close(control)
    finally:
        os.close(backing)


def _bind(loop: int, backing: int, name: bytes) -> bool:
    """Bind ``loop`` to the open file ``backing``, autoclear; False if another process
    bound that device first."""
    info = _INFO64.pack(0, 0, 0, 0, 0, 0, 0, 0, _LO_FLAGS_AUTOCLEAR, name[:63], b"", b"", 0, 0)
    try:
        fcntl.ioctl(loop, _LOOP_CONFIGURE, _CONFIG.pack(backing, 0, info, *[0] * 8))
        return True
    except OSError as e:
        if e.errno == errno.EBUSY:
            return False
        if e.errno not in (errno.EINVAL, errno.ENOTTY):  # a kernel before LOOP_CONFIGURE: two calls
            raise
    try:
        fcntl.ioctl(loop, _LOOP_SET_FD, backing)
    except OSError as e:
        if e.errno == errno.EBUSY:
            return False
        raise
    try:
        fcntl.ioctl(loop, _LOOP_SET_STATUS64, info)
    except BaseException:
        with contextlib.suppress(OSError):
            fcntl.ioctl(loop, _LOOP_CLR_FD, 0)
        raise
    return True


def _error(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")
