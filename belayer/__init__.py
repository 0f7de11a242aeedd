"""Belayer: fault tolerance for LLM agentic RL training.

Two halves usable apart: :mod:`belayer_env` (recoverable Docker sandboxes) and
:mod:`belayer_engine` (recoverable inference engine), over the base both share,
:mod:`belayer_core` (the failure taxonomy, the ``/proc`` reader, config-derived flags).
This package sits above all three: the ``belayer`` command line, and ``belayer.errors``,
the taxonomy under its first name.
Installed, it also ships the checkout's top-level ``wrappers/`` and ``examples/`` folders
as :mod:`belayer.wrappers` and :mod:`belayer.examples` (never as generic top-level names).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

__version__ = "0.1.0"

_FOLDERS = ("wrappers", "examples")
_HERE = Path(__file__).resolve().parent


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """From a source checkout (``belayer/`` a plain folder beside ``wrappers/`` and
    ``examples/``), ``belayer.wrappers`` / ``belayer.examples`` are those folders, exactly
    as an installed package ships them; their submodules then load from there as usual."""

    def __init__(self, root: Path):
        self.root = str(root)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] == __name__ and fullname.count(".") == 1 \
                and fullname.rpartition(".")[2] in _FOLDERS:
            return importlib.machinery.PathFinder.find_spec(fullname, [self.root])
        return None


def _install_checkout_finder() -> None:
    root = _HERE.parent
    if all((_HERE / name).is_dir() for name in _FOLDERS):  # installed: shipped inside this package
        return
    if not all((root / name / "__init__.py").is_file() for name in _FOLDERS):
        return
    if not any(isinstance(f, _CheckoutFolders) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFolders(root))


_install_checkout_finder()
