"""Belayer's CPU stand-in, on the SGLang server's PYTHONPATH only (see README.md here).

The PyPI torchvision's compiled ops do not load against a CPU build of torch, and
torchvision's Python part then fails at import registering fake kernels for
``torchvision::nms`` ("operator does not exist"). SGLang imports torchvision through
transformers but never calls nms. An import hook declares the two operator schemas right
before torchvision is first imported, so processes that never import torchvision do not
pay for importing torch here. Where torchvision's compiled ops do load (a CUDA machine's
image running CPU servers), they are loaded instead and nothing is declared: declaring a
schema they then register again aborts the process.
"""

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

_LIB = []  # keeps the torch.library.Library alive


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision" or _LIB:
            return None
        import torch

        if _own_ops_load(torch, path):
            _LIB.append(None)
            return None
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            if not hasattr(torch.ops.torchvision, op):
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIB.append(lib)
        return None  # the regular finders import torchvision itself


def _own_ops_load(torch, path) -> bool:
    """Whether torchvision's own compiled ops load against this torch (then they register
    nms themselves)."""
    spec = importlib.machinery.PathFinder.find_spec("torchvision", path)
    if spec is None or not spec.submodule_search_locations:
        return False
    for folder in spec.submodule_search_locations:
        for lib in Path(folder).glob("_C*.so"):
            try:
                torch.ops.load_library(str(lib))
                return True
            except OSError:  # built for another torch: undefined symbols
                return False
    return False


sys.meta_path.insert(0, _DeclareTorchvisionOps())
