"""Command line and environment of one SGLang server (``python -m sglang.launch_server``).

Torch-free. The server runs from SGLang's own virtual environment (set up by
``scripts/setup_sglang.sh``), never the project's. Settings that matter for recovery:
crash-dump sleeps off (a killed server's streams end in well under a second instead of
~6 s), 127.0.0.1 only, no warm-up request (it would write KV on a shadow), weights from
the weight-cache socket of the process that owns them (``--weight-cache-mode client``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from belayer_core.errors import ConfigError

DEFAULT_VENV = "/opt/belayer/sglang-venv"
SHIMS_DIR = Path(__file__).resolve().parent / "cpu_shims"
SETUP_HINT = "run `bash scripts/setup_sglang.sh` (or set BELAYER_SGLANG_VENV to an SGLang venv)"


class SGLangServerConfig(BaseModel):
    """One SGLang server; every field maps to a flag or an environment variable."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_path: str
    port: int = Field(ge=1, le=65535)
    host: str = "127.0.0.1"
    device: str = "cpu"
    weight_cache_socket: str | None = None  # None: SGLang loads the weights from disk
    venv: str | None = None  # None: $BELAYER_SGLANG_VENV or /opt/belayer/sglang-venv
    max_total_tokens: int = Field(default=4096, ge=64)
    context_length: int = Field(default=2048, ge=16)
    max_running_requests: int = Field(default=16, ge=1)
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's own dtype (config.json) on GPU
    attention_backend: str | None = None  # None: torch_native on CPU, triton on GPU
    threads: int = Field(default=1, ge=1, description="OMP threads of the CPU forward")
    memory_saver: bool = Field(default=False, description="GPU only: KV cache and CUDA graphs can be released "
                               "and resumed (torch_memory_saver); prefill CUDA graphs are off then")
    extra_args: list[str] = Field(default_factory=list)


def venv_dir(venv: str | None = None) -> Path:
    return Path(venv or os.environ.get("BELAYER_SGLANG_VENV") or DEFAULT_VENV)


def venv_python(venv: str | None = None) -> Path:
    """The SGLang venv's interpreter; ConfigError naming the set-up script when absent."""
    py = venv_dir(venv) / "bin" / "python"
    if not py.is_file():
        raise ConfigError(f"no SGLang environment at {venv_dir(venv)}: {SETUP_HINT}")
    return py


def is_cpu(device: str) -> bool:
    return device == "cpu"


def server_argv(cfg: SGLangServerConfig) -> list[str]:
    cpu = is_cpu(cfg.device)
    if cfg.memory_saver and cpu:
        raise ConfigError("memory_saver needs a CUDA device (torch_memory_saver releases GPU memory); device is cpu")
    argv = [str(venv_python(cfg.venv)), "-m", "sglang.launch_server",
            "--model-path", cfg.model_path, "--host", cfg.host, "--port", str(cfg.port),
            "--max-total-tokens", str(cfg.max_total_tokens),
            "--context-length", str(cfg.context_length),
            "--max-running-requests", str(cfg.max_running_requests),
            "--skip-server-warmup", "--log-level", "warning"]
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
    if cfg.memory_saver:
        # Prefill ("breakable") CUDA graphs cannot be captured under the saver's graph hook.
        argv += ["--enable-memory-saver", "--disable-prefill-cuda-graph"]
    return argv + cfg.extra_args


def checkpoint_dtype(model_path: str) -> str | None:
    """``torch_dtype`` (or ``dtype``) of an HF model dir's config.json; None when absent."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("torch_dtype") or config.get("dtype")
    return dtype if isinstance(dtype, str) else None


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
        env["OMP_NUM_THREADS"] = str(cfg.threads)
        if not _has_kernel_package(cfg.venv):
            paths.insert(0, str(SHIMS_DIR))
    else:
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # one GPU per server; NVLink multicast stays off
        if cfg.memory_saver:  # without it the `cuda_graph` tag releases nothing
            env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"
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


class SGLangBackend:
    """SGLang servers as workers and shadows (``WorkerBackend``), on the arena's weights.

    The slot's arena also serves SGLang's weight-cache protocol (``weight_cache.py``), so a
    worker and its shadow map one copy of the weights. A shadow is a started, idle SGLang
    server kept out of the routing table (SGLang has no "do not serve" mode; nothing is
    routed to it, and it runs no warm-up request). Ready = ``/health`` answers 200 and the
    arena registered the server (flushed, version set; every weight update re-syncs it).
    Promotion = one look at the arena's list: a shadow still registered has nothing to do;
    one dropped from an update is flushed and registered again first.

    On a GPU with ``torch_memory_saver`` in SGLang's environment, a shadow is started with
    SGLang's memory saver and, once ready, releases its KV cache and CUDA graphs: it then
    holds little more than a CUDA context (~1.2 GB for a 4B model instead of ~11 GB), and
    promotion resumes them first (~15 ms). ``shadow_memory_saver``: None = on where
    available, True = required (ConfigError where impossible), False = off.
    """

    name = "sglang"
    isolated_kv = True  # each server owns its KV; weights are read-only to it

    RELEASABLE = ("kv_cache", "cuda_graph")  # the weights belong to the arena, never released

    def __init__(self, model: str | None, extra_args: list[str] | None = None, venv: str | None = None,
                 device: str = "cpu", shadow_memory_saver: bool | None = None) -> None:
        if model is None:
            from .model_dir import embedded_config, ensure_embedded_model

            # SGLang's GPU kernels (RMSNorm, attention) take half precision only.
            model = str(ensure_embedded_model(cfg=None if is_cpu(device) else embedded_config(dtype="bfloat16")))
        self.model = model
        self.venv = venv
        self.extra_args = list(extra_args or [])
        venv_python(venv)  # fail now, naming the set-up script, not after a 3-minute timeout
        self.shadow_memory_saver = self._saver_wanted(device, shadow_memory_saver)
        self._arena_of: dict[str, str] = {}  # worker url -> arena socket
        self._released: set[str] = set()  # shadows whose KV and graphs are released

    def _saver_wanted(self, device: str, wanted: bool | None) -> bool:
        if wanted is False:
            return False
        if is_cpu(device):
            if wanted:
                raise ConfigError("sglang_shadow_memory_saver needs a CUDA device; device is cpu")
            return False
        present = has_package("torch_memory_saver", self.venv)
        if wanted and not present:
            raise ConfigError("sglang_shadow_memory_saver: torch_memory_saver is not installed in SGLang's "
                              f"environment ({venv_dir(self.venv)} or $BELAYER_SGLANG_PYTHONPATH)")
        return present

    @staticmethod
    def weight_cache_socket(slot) -> str:
        return str(Path(slot.run_dir) / f"wcache-{slot.name}.sock")

    def arena_argv(self, slot) -> list[str]:
        # KV lives inside each SGLang server: the arena keeps only a token KV region.
        return ["--model-dir", self.model, "--weight-cache-socket", self.weight_cache_socket(slot),
                "--num-blocks", "1", "--scratch-blocks", "1"]

    def worker_argv(self, slot, spec) -> list[str]:
        self._arena_of[f"http://{spec.host}:{spec.port}"] = str(slot.arena_socket)
        argv = ["-m", "belayer_engine.backends.sglang.server", "--model-path", self.model,
                "--host", spec.host, "--port", str(spec.port), "--device", slot.device,
                "--weight-cache-socket", self.weight_cache_socket(slot), "--worker-id", spec.worker_id,
                "--key-dir", str(slot.run_dir)]
        if self.venv:
            argv += ["--venv", self.venv]
        if spec.shadow and self.shadow_memory_saver:
            argv.append("--memory-saver")
        return argv + (["--shadow"] if spec.shadow else []) + self.extra_args

    def worker_env(self, base: dict[str, str]) -> dict[str, str]:
        return dict(base)  # server.py builds SGLang's own environment before it execs

    async def _register(self, session, url: str, role: str) -> int:
        """The arena pauses, flushes and re-versions the server on every weight update; it
        gets the worker secret's header for that over its 0600 same-uid socket."""
        import asyncio

        from belayer_engine.arena.client import ArenaClient

        client = ArenaClient(self._arena_of[url], timeout=60)
        return await asyncio.to_thread(client.register_server, url, role, 0, session.headers.get("Authorization"))

    async def ready(self, session, url: str, shadow: bool) -> bool:
        from belayer_engine.supervisor.processes import http_status

        if (await http_status(session, url + "/health"))[0] != 200:
            return False
        await self._register(session, url, "shadow" if shadow else "worker")
        if shadow and self.shadow_memory_saver:  # idle and unrouted: safe to release
            await self._memory(session, url, "release", timeout=60)
            self._released.add(url)
        return True

    async def _memory(self, session, url: str, action: str, timeout: float) -> None:
        """``/release_memory_occupation`` or ``/resume_memory_occupation`` of the KV cache and
        CUDA graphs; WorkerLost when the server refuses."""
        import aiohttp

        from belayer_core.errors import WorkerLost

        try:
            async with session.post(f"{url}/{action}_memory_occupation", json={"tags": list(self.RELEASABLE)},
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    raise WorkerLost(f"{url}/{action}_memory_occupation answered {resp.status}: {(await resp.text())[:200]}")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise WorkerLost(f"{url}/{action}_memory_occupation failed: {exc!r}") from exc

    async def promote(self, session, url: str, timeout: float) -> float | None:
        import time

        from belayer_core.errors import BelayerError, WorkerLost

        t0 = time.perf_counter()
        if url in self._released:  # KV and graphs back before anything can be routed here
            await self._memory(session, url, "resume", timeout)
            self._released.discard(url)
        try:
            if not await self._synced(url):  # dropped from an update: flush and re-sync first
                if not await self.flush(session, url, timeout):
                    raise WorkerLost(f"promote: {url}/flush_cache refused")
                await self._register(session, url, "worker")
        except BelayerError as exc:
            raise WorkerLost(f"promote: arena refused {url}: {exc}") from exc
        return time.perf_counter() - t0

    async def _synced(self, url: str) -> bool:
        """True while the arena lists the shadow as registered: it then has served nothing,
        maps the current weights and reports the current version (every update synced it),
        so promotion has nothing left to do."""
        import asyncio

        from belayer_engine.arena.client import ArenaClient

        info = await asyncio.to_thread(ArenaClient(self._arena_of[url], timeout=30).describe)
        return any(s["url"] == url for s in (info.get("weight_cache") or {}).get("servers", []))

    async def healthy(self, session, url: str, timeout: float) -> bool:
        import aiohttp

        from belayer_engine.supervisor.processes import http_status

        try:
            return (await http_status(session, url + "/health", timeout))[0] == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def flush(self, session, url: str, timeout: float) -> bool:
        import aiohttp

        try:
            async with session.post(url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
