"""Static helper programs Belayer builds at set-up (``scripts/native/``): one way to compile them.

Static, so that a program CRIU starts many times (the tmpfs tar, the loopback hook) loads no
shared library: a process start is most of what such a program costs on a small VM.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

NATIVE = Path(__file__).resolve().parents[2] / "scripts" / "native"


class BuildError(RuntimeError):
    """A helper could not be built, or does not do what it must."""


def compile_static(out: Path, sources: Sequence[Path], *, defines: Sequence[str] = (),
                   libs: Sequence[str] = ()) -> None:
    """``gcc -O2 -Wall -static`` ``sources`` into ``out``; ``BuildError`` saying why not."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError("no gcc (apt-get install build-essential zlib1g-dev)")
    r = subprocess.run([gcc, "-O2", "-Wall", "-static", *(f"-D{d}" for d in defines), "-o", str(out),
                        *map(str, sources), *(f"-l{lib}" for lib in libs)], capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"gcc failed on {', '.join(s.name for s in sources)}: {r.stderr.strip()[-400:]}")
