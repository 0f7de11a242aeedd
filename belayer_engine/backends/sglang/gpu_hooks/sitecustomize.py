"""Belayer's hook in a GPU SGLang server, on its PYTHONPATH only when it is asked for
(``BELAYER_CUDA_STACK_BYTES``, set by ``launcher.server_env``); see README.md here.

A CUDA context reserves local memory for every thread the GPU can hold at once, sized by
the per-thread stack limit (1 KiB by default: ~200 MiB of the ~630 MiB a torch context
takes on an H200). SGLang leaves the limit alone. This lowers it in each scheduler process
as soon as the scheduler picks its device, before any kernel runs: every kernel launched
after, those captured into CUDA graphs included, makes the driver raise the limit to what
it needs. Lowered later (after the graphs were captured), replayed graph kernels overflow
their stack: "unspecified launch failure" on the H200, seen on the first decode.
Runs in SGLang's interpreter: standard library at import, torch only once SGLang loaded it.
"""

import ctypes
import importlib.abc
import importlib.util
import os
import sys

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
STACK_LIMIT = 0  # cudaLimitStackSize


def _stack_limit(set_to: int | None = None) -> tuple[int, int] | None:
    """(before, after) of the current device's per-thread stack limit, set first when
    ``set_to`` is given; None before CUDA is initialised or without the runtime library."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libcudart" in line]
    if not paths:
        return None
    rt = ctypes.CDLL(paths[0])
    before, after = ctypes.c_size_t(), ctypes.c_size_t()
    rt.cudaDeviceGetLimit(ctypes.byref(before), STACK_LIMIT)
    if set_to is not None:
        rt.cudaDeviceSetLimit(STACK_LIMIT, ctypes.c_size_t(set_to))
    rt.cudaDeviceGetLimit(ctypes.byref(after), STACK_LIMIT)
    return before.value, after.value


def _report(what: str, limits: tuple[int, int] | None) -> None:
    text = f"{limits[0]} -> {limits[1]} bytes" if limits else "left as it is (no CUDA runtime in this process)"
    print(f"belayer: CUDA per-thread stack {what}: {text}", file=sys.stderr, flush=True)


def _install(scheduler_module, nbytes: int) -> None:
    """Lower the limit right after the scheduler's first ``torch.cuda.set_device`` (before
    the model, the KV pool and the CUDA graphs); report the limit the kernels left once the
    scheduler is built."""
    import torch

    set_device = torch.cuda.set_device
    lowered = []

    def set_device_then_lower(device):
        set_device(device)
        if not lowered:
            lowered.append(True)
            _report("lowered", _stack_limit(nbytes))

    torch.cuda.set_device = set_device_then_lower
    init = scheduler_module.Scheduler.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        limits = _stack_limit()
        _report("once built", limits and (nbytes, limits[1]))

    scheduler_module.Scheduler.__init__ = __init__


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
            _install(module, self.nbytes)

        spec.loader.exec_module = exec_and_wrap
        return spec


def _run_the_next_sitecustomize() -> None:
    """Python imports one ``sitecustomize``: this one shadows any later on the path (another
    hook of Belayer's, the environment's own), so run the next one after this folder."""
    import runpy

    here = os.path.dirname(os.path.abspath(__file__))
    dirs = [os.path.abspath(e or ".") for e in sys.path]
    start = dirs.index(here) + 1 if here in dirs else 0
    for entry in dirs[start:]:
        candidate = os.path.join(entry, "sitecustomize.py")
        if entry != here and os.path.isfile(candidate):
            runpy.run_path(candidate, run_name="sitecustomize")
            return


_bytes = int(os.environ.get("BELAYER_CUDA_STACK_BYTES", "0") or 0)
if _bytes > 0:
    sys.meta_path.insert(0, _SchedulerHook(_bytes))
_run_the_next_sitecustomize()
