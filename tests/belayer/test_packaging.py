"""An install holds ``belayer.wrappers`` / ``belayer.examples`` (folders of the ``belayer``
package, never generic top-level names that would collide in site-packages); a checkout
imports the same names from the same folders, with no import hook."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMPORTS = ("import belayer.wrappers.chat_history as c, belayer.examples.swe_rl.config as e, belayer.wrappers as w; "
           "print(c.__file__); print(e.__file__); print(w.ChatHistory.__module__)")


def _python(code: str, cwd: Path, path: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.timeout(300)
def test_a_non_editable_install_ships_wrappers_and_examples_inside_belayer(tmp_path):
    src = tmp_path / "src"  # a copy of the tracked files: the build writes into its source tree
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    target = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--target", str(target), str(src)], capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr[-3000:]

    top = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"}
    assert top == {"belayer", "belayer_core", "belayer_env", "belayer_engine"}
    chat, config, module = _python(IMPORTS, cwd=tmp_path, path=target)
    assert chat == str(target / "belayer" / "wrappers" / "chat_history.py")
    assert config == str(target / "belayer" / "examples" / "swe_rl" / "config.py")
    assert module == "belayer.wrappers.chat_history"


def test_belayer_installs_no_import_hook() -> None:
    """A reader follows ``belayer.wrappers`` to ``belayer/wrappers/``: no finder of ours."""
    out = subprocess.run([sys.executable, "-c", "import sys; n = len(sys.meta_path); import belayer.wrappers, "
                          "belayer.examples; print(len(sys.meta_path) - n)"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "0"


def test_a_checkout_imports_the_same_names_from_its_folders(tmp_path):
    chat, config, module = _python(IMPORTS, cwd=tmp_path, path=REPO)
    assert chat == str(REPO / "belayer" / "wrappers" / "chat_history.py")
    assert config == str(REPO / "belayer" / "examples" / "swe_rl" / "config.py")
    assert module == "belayer.wrappers.chat_history"
