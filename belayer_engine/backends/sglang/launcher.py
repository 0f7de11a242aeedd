"""Command line and environment of one SGLang server (``python -m sglang.launch_server``).

Torch-free. The server runs from SGLang's own virtual environment (set up by
``scripts/setup_sglang.sh``), never the project's. Settings that matter for recovery:
crash-dump sleeps off (a killed server's streams end in well under a second instead of
~6 s), 127.0.0.1 only, SGLang's own warm-up request skipped (ready sooner; a shadow is
warmed by ``backend.py`` instead), an idle scheduler sleeping on its sockets rather than
spinning a core (``--sleep-on-idle``), weights from the weight-cache socket of the process
that owns them (``--weight-cache-mode client``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from belayer_core.errors import ConfigError

from .sizing import CPU_CONTEXT, CPU_KV_TOKENS, CPU_RUNNING, checkpoint_dtype, flag_value, is_cpu

DEFAULT_VENV = "/opt/belayer/sglang-venv"
SHIMS_DIR = Path(__file__).resolve().parent / "cpu_shims"
GPU_HOOKS_DIR = Path(__file__).resolve().parent / "gpu_hooks"
KV_HOOKS_DIR = Path(__file__).resolve().parent / "kv_hooks"
THREADS_VAR = "BELAYER_SGLANG_CPU_THREADS"  # the CPU servers' threads (per rank) where the engine starts them
NO_NCCL = "/nonexistent/belayer-cpu-servers-use-no-nccl.so"  # SGLANG_NCCL_SO_PATH of CPU servers
SETUP_HINT = "run `bash scripts/setup_sglang.sh` (or set BELAYER_SGLANG_VENV to an SGLang venv)"


def _env_threads() -> int:
    value = os.environ.get(THREADS_VAR, "1")
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{THREADS_VAR}={value!r}: a positive number of cores per rank")
    return int(value)


class SGLangServerConfig(BaseModel):
    """One SGLang server; every field maps to a flag or an environment variable."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_path: str
    port: int = Field(ge=1, le=65535)
    host: str = "127.0.0.1"
    device: str = "cpu"
    weight_cache_socket: str | None = None  # None: SGLang loads the weights from disk
    venv: str | None = None  # None: $BELAYER_SGLANG_VENV or /opt/belayer/sglang-venv
    max_total_tokens: int = Field(default=CPU_KV_TOKENS, ge=64)
    context_length: int = Field(default=CPU_CONTEXT, ge=16)
    max_running_requests: int = Field(default=CPU_RUNNING, ge=1)
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's own dtype (config.json) on GPU
    attention_backend: str | None = None  # None: torch_native on CPU, triton on GPU
    threads: int = Field(default_factory=_env_threads, ge=1, description=(
        f"OMP threads of the CPU forward (of each tensor-parallel rank); default ${THREADS_VAR} or 1"))
    shadow: bool = Field(default=False, description="a shadow: on CPU its tensor-parallel ranks take the cores "
                         "after the worker's where the machine has enough")
    memory_saver: bool = Field(default=False, description="GPU only: the KV cache can be released and resumed "
                               "(torch_memory_saver)")
    memory_saver_graphs: bool = Field(default=False, description="with memory_saver: the CUDA graphs can be "
                                      "released too (their memory under the saver); prefill CUDA graphs are off then")
    cuda_stack_bytes: int = Field(default=0, ge=0, description="GPU only: the scheduler's CUDA per-thread stack "
                                  "limit once it is built (gpu_hooks/); 0 = the driver's default (1 KiB)")
    expandable_segments: bool | None = Field(default=None, description=(
        "GPU only: torch's allocator maps memory in growable segments (PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True; ~130 MiB less per server on an H200, same greedy ids). None: on for a "
        "one-GPU server where memory_saver is off (torch_memory_saver sees only cudaMalloc, which expandable "
        "segments bypass); a PYTORCH_CUDA_ALLOC_CONF in the environment wins"))
    cublas_workspace_mib: int | None = Field(default=None, ge=0, multiple_of=4, description=(
        "GPU only: torch's cuBLAS workspace per handle and stream (CUBLAS_WORKSPACE_CONFIG). None: 8 MiB on "
        "a one-GPU server (~156 MiB less per server on an H200 than torch's 32, same greedy ids and batch "
        "decode time); 0: torch's default; a CUBLAS_WORKSPACE_CONFIG in the environment wins"))
    kv_arena: str | None = Field(default=None, description=(
        "the arena's control socket when the KV pool lives in the arena (kv_hooks/): the server maps the "
        "arena's pool and request table, journals what a successor may adopt; None: the server owns its KV"))
    kv_role: str = Field(default="worker", pattern="^(worker|shadow)$", description="with kv_arena: this server's role")
    kv_sid: str | None = Field(default=None, description="with kv_arena: the server's id in the arena (its URL)")
    extra_args: list[str] = Field(default_factory=list)


def venv_dir(venv: str | None = None) -> Path:
    return Path(venv or os.environ.get("BELAYER_SGLANG_VENV") or DEFAULT_VENV)


def venv_python(venv: str | None = None) -> Path:
    """The SGLang venv's interpreter; ConfigError naming the set-up script when absent."""
    py = venv_dir(venv) / "bin" / "python"
    if not py.is_file():
        raise ConfigError(f"no SGLang environment at {venv_dir(venv)}: {SETUP_HINT}")
    return py


def server_argv(cfg: SGLangServerConfig) -> list[str]:
    cpu = is_cpu(cfg.device)
    if cfg.memory_saver and cpu:
        raise ConfigError("memory_saver needs a CUDA device (torch_memory_saver releases GPU memory); device is cpu")
    if cfg.memory_saver_graphs and not cfg.memory_saver:
        raise ConfigError("memory_saver_graphs needs memory_saver")
    if cfg.cuda_stack_bytes and cpu:
        raise ConfigError(f"cuda_stack_bytes={cfg.cuda_stack_bytes} needs a CUDA device; device is cpu")
    if cfg.expandable_segments and (cpu or cfg.memory_saver):
        raise ConfigError("expandable_segments needs a CUDA device and no memory_saver (the saver releases only "
                          f"what cudaMalloc gave); device {cfg.device}, memory_saver {cfg.memory_saver}")
    if cfg.cublas_workspace_mib and cpu:
        raise ConfigError(f"cublas_workspace_mib={cfg.cublas_workspace_mib} needs a CUDA device; device is cpu")
    argv = [str(venv_python(cfg.venv)), "-m", "sglang.launch_server",
            "--model-path", cfg.model_path, "--host", cfg.host, "--port", str(cfg.port),
            "--max-total-tokens", str(cfg.max_total_tokens),
            "--context-length", str(cfg.context_length),
            "--max-running-requests", str(cfg.max_running_requests),
            "--skip-server-warmup", "--log-level", "warning",
            # an idle scheduler waits on its sockets (woken by the next message) instead of
            # spinning a core: an idle shadow otherwise takes one of CI's two cores from its
            # worker (CPU decode step 15-17 ms -> 11 ms at 1,024 x 4, this VM)
            "--sleep-on-idle"]
    if cpu:
        argv += ["--device", "cpu", "--attention-backend", cfg.attention_backend or "torch_native",
                 "--dtype", cfg.dtype or "float32"]
    else:
        argv += ["--attention-backend", cfg.attention_backend or "triton",
                 "--sampling-backend", "pytorch", "--grammar-backend", "none"]
        # Explicitly the checkpoint's own dtype: SGLang's "auto" turns a float32 checkpoint into
        # float16 on a GPU, and a weight-cache client then refuses the arena's float32 tensors.
        dtype = cfg.dtype or checkpoint_dtype(cfg.model_path)
        if dtype:
            argv += ["--dtype", dtype]
        if cfg.device.startswith("cuda:"):
            argv += ["--base-gpu-id", cfg.device.split(":", 1)[1]]
    if cfg.weight_cache_socket:
        argv += ["--weight-cache-mode", "client", "--weight-cache-socket", cfg.weight_cache_socket]
    if cfg.kv_arena:
        if cfg.memory_saver:
            raise ConfigError("kv_arena: the KV pool is the arena's, the memory saver has no KV to release")
        argv += ["--page-size", "1"]  # the arena's pool and a successor's adoption are per token
    if cfg.memory_saver:
        argv.append("--enable-memory-saver")
        if cfg.memory_saver_graphs:  # prefill ("breakable") CUDA graphs cannot be captured under its graph hook
            argv.append("--disable-prefill-cuda-graph")
    return argv + cfg.extra_args


def expandable_segments(cfg: SGLangServerConfig) -> bool:
    """Whether the server's torch allocator grows segments in place instead of caching
    whole ``cudaMalloc`` blocks: less memory reserved but unused (measured on an H200 in
    ``benchmarks/sglang_server_memory.py``), the same kernels and results."""
    if cfg.expandable_segments is None:  # a server over several GPUs: not measured, left as SGLang has it
        return not is_cpu(cfg.device) and not cfg.memory_saver and tp_size(cfg.extra_args) == 1
    return cfg.expandable_segments


DEFAULT_CUBLAS_WORKSPACE_MIB = 8


def cublas_workspace_mib(cfg: SGLangServerConfig) -> int:
    """The server's cuBLAS workspace in MiB (0: torch's own default). Measured on an H200
    (``benchmarks/sglang_server_memory.py``): 8 instead of torch's 32 MiB takes 156 MiB
    off a server (torch keeps a workspace per cuBLAS handle and stream; which ones make up
    the 156 was not traced), with the same greedy ids and batch decode time."""
    if cfg.cublas_workspace_mib is None:  # several GPUs: not measured, left as torch has it
        return 0 if is_cpu(cfg.device) or tp_size(cfg.extra_args) != 1 else DEFAULT_CUBLAS_WORKSPACE_MIB
    return cfg.cublas_workspace_mib


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads both (the second is newer)


def inherited_expandable(env: Mapping[str, str]) -> str | None:
    """The variable of ``env`` that turns torch's expandable segments on (None: none does)."""
    for var in ALLOC_CONF_VARS:
        options = [o.replace(" ", "").lower() for o in env.get(var, "").split(",")]
        if "expandable_segments:true" in options:
            return var
    return None


TP_FLAGS = ("--tp-size", "--tp", "--tensor-parallel-size")


def tp_size(extra_args: list[str]) -> int:
    """The tensor-parallel size SGLang flags in ``extra_args`` ask for (1 when none do)."""
    value = flag_value(extra_args, TP_FLAGS) or ""
    return int(value) if value.isdigit() else 1


BIND_VAR = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's per-rank core lists, "0-3|4-7"


def numa_nodes() -> int:
    return max(1, len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))))


def cpu_binding(tp: int, threads: int, shadow: bool, cores: list[int] | None = None) -> str:
    """SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` for ``tp`` ranks of ``threads`` cores each
    (SGLang binds a rank per NUMA node by default and refuses more ranks than nodes). The
    worker's ranks take the first cores this process may run on; a shadow's the next ones
    where there are enough (an idle shadow's warm-up, and a re-armed shadow's start, then
    never slow the serving worker), else the worker's own (an idle shadow only waits)."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    need = tp * threads
    start = need if shadow and len(cores) >= 2 * need else 0
    groups = []
    for rank in range(tp):
        ids = [cores[(start + rank * threads + i) % len(cores)] for i in range(threads)]
        groups.append(",".join(_ranges(ids)))
    return "|".join(groups)


def _ranges(ids: list[int]) -> list[str]:
    out: list[list[int]] = []
    for i in ids:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return [f"{a}-{b}" if b > a else str(a) for a, b in out]


def server_env(cfg: SGLangServerConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: SGLang's venv only, plus the CPU stand-ins on CPU."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(SGLANG_PYSPY_DUMP_BEFORE_CRASH="0", SGLANG_CUDA_COREDUMP_BEFORE_CRASH="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    # SGLang installed as a folder of unpacked wheels rather than a venv (the GPU bundle of
    # scripts/build_sglang_gpu_bundle.sh): BELAYER_SGLANG_PYTHONPATH names that folder.
    paths = [p for p in (env.pop("BELAYER_SGLANG_PYTHONPATH", ""),) if p]
    if is_cpu(cfg.device):
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        # On a machine with a GPU, SGLang would also take its CUDA kernels' paths (its is_cuda()
        # asks torch) and fail on CPU tensors: a CPU server sees no GPU.
        env["CUDA_VISIBLE_DEVICES"] = ""
        # Nor NCCL: SGLang 0.5.17 builds a NCCL communicator for tp > 1 wherever the library
        # loads (a CUDA torch brings it) and then asks for a CUDA device; without it, its
        # ranks talk over torch's CPU group, as on a machine without NCCL.
        env["SGLANG_NCCL_SO_PATH"] = NO_NCCL
        env["OMP_NUM_THREADS"] = str(cfg.threads)
        tp = tp_size(cfg.extra_args)
        if tp > 1 and BIND_VAR not in env and numa_nodes() < tp:  # the user's own binding wins
            env[BIND_VAR] = cpu_binding(tp, cfg.threads, cfg.shadow)
        if not _has_kernel_package(cfg.venv):
            paths.insert(0, str(SHIMS_DIR))
    else:
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # one GPU per server; NVLink multicast stays off
        if cfg.cuda_stack_bytes:
            env["BELAYER_CUDA_STACK_BYTES"] = str(cfg.cuda_stack_bytes)
            paths.insert(0, str(GPU_HOOKS_DIR))
        if cfg.memory_saver and (var := inherited_expandable(env)):
            raise ConfigError(f"memory_saver releases only what cudaMalloc gave, and {var}={env[var]} turns "
                              "torch's expandable segments on: unset it for SGLang's servers, or turn the "
                              "memory saver off")
        if cfg.memory_saver and cfg.memory_saver_graphs:  # without it the `cuda_graph` tag releases nothing
            env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"
        if expandable_segments(cfg):
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if mib := cublas_workspace_mib(cfg):  # torch reads ":KiB:count" pairs
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", f":4096:{mib // 4}")
    if cfg.kv_arena:  # first on the path: its sitecustomize runs the next one (the stand-ins, gpu_hooks)
        env.update(BELAYER_KV_ARENA=cfg.kv_arena, BELAYER_KV_ROLE=cfg.kv_role,
                   BELAYER_KV_SID=cfg.kv_sid or f"http://{cfg.host}:{cfg.port}")
        paths.insert(0, str(KV_HOOKS_DIR))
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _has_kernel_package(venv: str | None) -> bool:
    """True when SGLang's real kernel package is installed in the venv (no stand-ins then)."""
    lib = venv_dir(venv) / "lib"
    return any(lib.glob("python3*/site-packages/sgl_kernel/__init__.py"))


def has_package(package: str, venv: str | None = None) -> bool:
    """True when ``package`` is importable in SGLang's environment: its venv, or the folder
    of unpacked wheels named by BELAYER_SGLANG_PYTHONPATH (the GPU bundle)."""
    roots = list((venv_dir(venv) / "lib").glob("python3*/site-packages"))
    roots += [Path(p) for p in os.environ.get("BELAYER_SGLANG_PYTHONPATH", "").split(os.pathsep) if p]
    return any((root / package / "__init__.py").is_file() for root in roots)
