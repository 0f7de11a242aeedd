"""Belayer's KV hook in an SGLang server, on its PYTHONPATH only when the engine keeps the KV
pool in the arena (``BELAYER_KV_ARENA``, set by ``launcher.server_env``); see README.md here.

Wraps the SGLang methods ``belayer_kv_patch.PATCHES`` names, each as its module is first
imported (the server, its scheduler and detokenizer processes each run this at start).
Standard library at import; the patches import torch and numpy once SGLang has.
"""

import importlib.abc
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches):
        self.patches = dict(patches)

    def find_spec(self, name, path=None, target=None):
        patch = self.patches.pop(name, None)
        if patch is None:
            return None
        sys.meta_path.remove(self)  # the regular finders locate the module
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if self.patches:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _run_the_next_sitecustomize() -> None:
    """Python imports one ``sitecustomize``: run the next one on the path after this folder
    (another hook of Belayer's, or the environment's own)."""
    import runpy

    dirs = [os.path.abspath(e or ".") for e in sys.path]
    start = dirs.index(HERE) + 1 if HERE in dirs else 0
    for entry in dirs[start:]:
        candidate = os.path.join(entry, "sitecustomize.py")
        if entry != HERE and os.path.isfile(candidate):
            runpy.run_path(candidate, run_name="sitecustomize")
            return


if os.environ.get("BELAYER_KV_ARENA"):
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import belayer_kv_patch

    sys.meta_path.insert(0, _PatchOnImport(belayer_kv_patch.PATCHES))
_run_the_next_sitecustomize()
