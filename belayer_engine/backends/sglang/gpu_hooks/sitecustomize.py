"""Belayer's hook in a GPU SGLang server, on its PYTHONPATH only when it is asked for
(``BELAYER_CUDA_STACK_BYTES``, set by ``launcher.server_env``); see README.md here.

A CUDA context reserves local memory for every thread the GPU can hold at once, sized by
the per-thread stack limit (1 KiB by default: ~200 MiB of the ~630 MiB a torch context
takes on an H200). SGLang leaves the limit alone. This lowers it in each scheduler process
once the scheduler is built (model mapped, KV pool allocated, CUDA graphs captured); the
driver raises it again for any later kernel that needs more, so nothing runs short.
Runs in SGLang's interpreter: standard library at import, torch only once SGLang loaded it.
"""

import ctypes
import importlib.abc
import importlib.util
import os
import sys

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
STACK_LIMIT = 0  # cudaLimitStackSize


def _lower_stack(nbytes: int) -> None:
    import torch

    if not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libcudart" in line]
    if not paths:
        print("belayer: CUDA runtime not found; per-thread stack left as it is", file=sys.stderr)
        return
    rt = ctypes.CDLL(paths[0])
    before, after = ctypes.c_size_t(), ctypes.c_size_t()
    rt.cudaDeviceGetLimit(ctypes.byref(before), STACK_LIMIT)
    rc = rt.cudaDeviceSetLimit(STACK_LIMIT, ctypes.c_size_t(nbytes))
    rt.cudaDeviceGetLimit(ctypes.byref(after), STACK_LIMIT)
    print(f"belayer: CUDA per-thread stack {before.value} -> {after.value} bytes (rc {rc})",
          file=sys.stderr, flush=True)


def _after_init(scheduler_class: type, nbytes: int) -> None:
    init = scheduler_class.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _lower_stack(nbytes)

    scheduler_class.__init__ = __init__


class _SchedulerHook(importlib.abc.MetaPathFinder):
    """Wraps ``Scheduler.__init__`` as SGLang's scheduler module is first imported."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def find_spec(self, name, path=None, target=None):
        if name != SCHEDULER_MODULE:
            return None
        sys.meta_path.remove(self)  # the regular finders locate the module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _after_init(module.Scheduler, self.nbytes)

        spec.loader.exec_module = exec_and_wrap
        return spec


def _run_the_next_sitecustomize() -> None:
    """Python imports one ``sitecustomize``: this one shadows any later on the path (the
    environment's own), so run that one too."""
    import runpy

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != here and os.path.isfile(candidate):
            runpy.run_path(candidate, run_name="sitecustomize")
            return


_bytes = int(os.environ.get("BELAYER_CUDA_STACK_BYTES", "0") or 0)
if _bytes > 0:
    sys.meta_path.insert(0, _SchedulerHook(_bytes))
_run_the_next_sitecustomize()
