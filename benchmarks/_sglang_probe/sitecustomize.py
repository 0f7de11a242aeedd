"""Memory probe inside a GPU SGLang server's scheduler, for ``sglang_server_memory.py --probe``.

On the server's PYTHONPATH after Belayer's ``gpu_hooks`` (which runs this file as the next
``sitecustomize``). In the scheduler process only, it writes one JSON line per phase to
``$BELAYER_MEMORY_PROBE_DIR/phases-<pid>.jsonl``: the process's GPU memory as the driver
counts it (nvidia-smi), torch's allocated and reserved bytes, and the CUDA module loading
mode. Phases: ``context`` (right after the first ``torch.cuda.set_device``, stack limit
lowered), ``built`` (the scheduler's ``__init__`` returned: weights mapped, KV pool, CUDA
graphs) and ``flushed-N`` (after each ``/flush_cache``). From ``context`` on it records
torch's allocation history and, at each flush, summarises torch's memory snapshot: bytes
by the SGLang source line that allocated them, and reserved-but-free bytes by pool.
Benchmark-only: never on a served engine's path.
"""

import ctypes
import importlib.abc
import importlib.util
import json
import os
import sys
import time

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
OUT = os.environ.get("BELAYER_MEMORY_PROBE_DIR", "")
MIB = 1 << 20


def _nvidia_smi_mib() -> float | None:
    """This process's GPU MiB, read by the benchmarks' own ``_procmem.gpu_mib`` (loaded by
    path: the server's PYTHONPATH holds SGLang's environment, not ``benchmarks/``)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_procmem.py")
    spec = importlib.util.spec_from_file_location("_belayer_bench_procmem", path)
    procmem = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(procmem)
    return procmem.gpu_mib().get(os.getpid())


def _module_loading_mode() -> str | None:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        mode = ctypes.c_int()
        if cuda.cuModuleGetLoadingMode(ctypes.byref(mode)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return {1: "eager", 2: "lazy"}.get(mode.value, str(mode.value))


def _sglang_frame(frames: list[dict]) -> str:
    """The innermost SGLang source line of an allocation's stack (else the innermost)."""
    for frame in frames:
        name = frame.get("filename", "")
        if "/sglang/" in name:
            return f"{name.split('/sglang/', 1)[1]}:{frame.get('line')} {frame.get('name')}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line')}" if frames else "?"


def _snapshot_summary() -> dict:
    import torch

    snap = torch.cuda.memory._snapshot()
    by_site: dict[str, int] = {}
    free_by_pool: dict[str, int] = {}
    reserved_by_pool: dict[str, int] = {}
    for seg in snap.get("segments", []):
        pool = str(seg.get("segment_pool_id", (0, 0)))
        reserved_by_pool[pool] = reserved_by_pool.get(pool, 0) + seg["total_size"]
        for block in seg.get("blocks", []):
            if block["state"] == "active_allocated":
                site = _sglang_frame(block.get("frames", []))
                by_site[site] = by_site.get(site, 0) + block["size"]
            else:
                free_by_pool[pool] = free_by_pool.get(pool, 0) + block["size"]
    top = sorted(by_site.items(), key=lambda kv: -kv[1])[:40]
    return {"allocated_by_site_mib": {k: round(v / MIB, 1) for k, v in top},
            "reserved_by_pool_mib": {k: round(v / MIB, 1) for k, v in reserved_by_pool.items()},
            "free_in_reserved_by_pool_mib": {k: round(v / MIB, 1) for k, v in free_by_pool.items()}}


def _phase(name: str, summary: bool = False) -> None:
    try:
        _write_phase(name, summary)
    except Exception as exc:  # noqa: BLE001 (a probe reports, never breaks the server)
        print(f"probe: phase {name} failed: {exc!r}", file=sys.stderr, flush=True)


def _write_phase(name: str, summary: bool) -> None:
    import torch

    torch.cuda.synchronize()
    row = {"phase": name, "t": round(time.time(), 3), "pid": os.getpid(), "smi_mib": _nvidia_smi_mib(),
           "torch_allocated_mib": round(torch.cuda.memory_allocated() / MIB, 1),
           "torch_reserved_mib": round(torch.cuda.memory_reserved() / MIB, 1),
           "module_loading": _module_loading_mode()}
    if summary:
        try:
            row["snapshot"] = _snapshot_summary()
        except Exception as exc:  # noqa: BLE001 (a probe reports, never breaks the server)
            row["snapshot_error"] = repr(exc)
    with open(os.path.join(OUT, f"phases-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def _install(scheduler_module) -> None:
    import torch

    set_device = torch.cuda.set_device  # Belayer's stack-lowering wrapper when gpu_hooks ran first
    started = []

    def set_device_then_probe(device):
        set_device(device)
        if not started:
            started.append(True)
            _phase("context")
            try:
                torch.cuda.memory._record_memory_history(max_entries=100000)
            except Exception as exc:  # noqa: BLE001
                print(f"probe: no memory history: {exc!r}", file=sys.stderr, flush=True)

    torch.cuda.set_device = set_device_then_probe
    cls = scheduler_module.Scheduler
    init, flush = cls.__init__, cls.flush_cache

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _phase("built", summary=True)

    flushes = []

    def flush_cache(self, *args, **kwargs):
        result = flush(self, *args, **kwargs)
        flushes.append(True)
        _phase(f"flushed-{len(flushes)}", summary=True)
        return result

    cls.__init__, cls.flush_cache = __init__, flush_cache


class _ProbeHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != SCHEDULER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_probe(module):
            exec_module(module)
            _install(module)

        spec.loader.exec_module = exec_and_probe
        return spec


def _run_the_next_sitecustomize() -> None:
    """The environment's own ``sitecustomize``, if one comes after this one on the path."""
    import runpy

    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(e or ".") for e in sys.path]
    for entry in entries[entries.index(here) + 1:] if here in entries else []:
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            runpy.run_path(candidate, run_name="sitecustomize")
            return


if OUT:
    sys.meta_path.insert(0, _ProbeHook())
_run_the_next_sitecustomize()
