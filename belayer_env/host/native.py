"""Static helper programs Belayer builds at set-up (``scripts/native/``): one way to compile them.

Static, so that a program CRIU starts many times (the tmpfs tar, the loopback hook) loads no
shared library: a process start is most of what such a program costs on a small VM. Against
musl where it is installed and the program needs no other library: glibc's start-up alone
(its CPU feature probing traps to the hypervisor on a VM) took 0.68 ms per fork + exec on
the 2-core VM here, musl's 0.11 ms.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

NATIVE = Path(__file__).resolve().parents[2] / "scripts" / "native"


class BuildError(RuntimeError):
    """A helper could not be built, or does not do what it must."""


def compile_static(out: Path, sources: Sequence[Path], *, defines: Sequence[str] = (),
                   libs: Sequence[str] = (), libc: str = "auto") -> str:
    """``gcc -O2 -Wall -static`` ``sources`` into ``out``; returns the C library used (``musl``
    or ``glibc``); ``BuildError`` saying why not. ``libc="auto"``: through ``musl-gcc`` first
    where it is installed (the kernel's headers and, for ``libs=["z"]``, the host's static
    zlib beside it), else glibc; a caller that checks the result may retry with glibc."""
    if libc not in ("auto", "musl", "glibc"):
        raise ValueError(f"libc must be auto, musl or glibc, got {libc!r}")
    names = ", ".join(s.name for s in sources)
    musl = shutil.which("musl-gcc") if libc != "glibc" else None
    if musl is not None:
        why = _musl(musl, out, sources, defines, libs)
        if why is None:
            return "musl"
        if libc == "musl":
            raise BuildError(why)
    elif libc == "musl":
        raise BuildError("no musl-gcc (apt-get install musl-tools)")
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError("no gcc (apt-get install build-essential zlib1g-dev)")
    r = _cc(gcc, out, sources, defines, [f"-l{lib}" for lib in libs])
    if r.returncode != 0:
        raise BuildError(f"gcc failed on {names}: {r.stderr.strip()[-400:]}")
    return "glibc"


_HEADERS = ("linux", "asm", "asm-generic", "zlib.h", "zconf.h")
"""What a musl build may take of the host's headers (musl ships none of the kernel's)."""


def _musl(musl: str, out: Path, sources: Sequence[Path], defines: Sequence[str], libs: Sequence[str]) -> str | None:
    """Build with musl: None, or why not. Only the kernel's and zlib's headers are taken from
    the host (never glibc's), each linked into a private include folder."""
    gcc = shutil.which("gcc")
    multiarch = subprocess.run([gcc, "-print-multiarch"], capture_output=True, text=True).stdout.strip() if gcc else ""
    roots = [Path("/usr/include") / multiarch] if multiarch else []
    roots.append(Path("/usr/include"))
    archives = []
    for lib in libs:
        found = subprocess.run([gcc, f"-print-file-name=lib{lib}.a"], capture_output=True,
                               text=True).stdout.strip() if gcc and lib == "z" else ""
        if not Path(found).is_absolute():
            return f"musl links no lib{lib} here"
        archives.append(found)
    with tempfile.TemporaryDirectory(prefix="belayer-musl-") as inc:
        for name in _HEADERS:
            for root in roots:
                if (root / name).exists():
                    (Path(inc) / name).symlink_to(root / name)
                    break
        r = _cc(musl, out, sources, defines, archives, [f"-I{inc}"])
    return None if r.returncode == 0 else f"musl-gcc failed on {', '.join(s.name for s in sources)}: " \
                                          f"{r.stderr.strip()[-400:]}"


def _cc(cc: str, out: Path, sources: Sequence[Path], defines: Sequence[str], link: Sequence[str],
        flags: Sequence[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([cc, "-O2", "-Wall", "-static", *flags, *(f"-D{d}" for d in defines), "-o", str(out),
                           *map(str, sources), *link], capture_output=True, text=True)
