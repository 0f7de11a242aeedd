"""Belayer's CPU stand-in, on the SGLang server's PYTHONPATH only (see README.md here).

The PyPI torchvision's compiled ops do not load against a CPU build of torch, and
torchvision's Python part then fails at import registering fake kernels for
``torchvision::nms`` ("operator does not exist"). SGLang imports torchvision through
transformers but never calls nms. An import hook declares the two operator schemas right
before torchvision is first imported, so processes that never import torchvision do not
pay for importing torch here.
"""

import importlib.abc
import sys

_LIB = []  # keeps the torch.library.Library alive


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision" or _LIB:
            return None
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            if not hasattr(torch.ops.torchvision, op):
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIB.append(lib)
        return None  # the regular finders import torchvision itself


sys.meta_path.insert(0, _DeclareTorchvisionOps())
