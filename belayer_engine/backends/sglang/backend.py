"""SGLang servers as the engine's workers and shadows (a ``WorkerBackend``), on the arena's weights.

The slot's arena serves SGLang's weight-cache protocol (``weight_cache.py``) and holds the
weights once, in SGLang's layout (``--no-reference-slots``), so a worker and its shadow map
one copy. A shadow is a started SGLang server kept out of the routing table (SGLang has no
"do not serve" mode). Ready = ``/health`` answers 200, the shadow has run its warm-up, and
the arena registered the server (flushed, version set; every weight update re-syncs it).

Where the KV lives (``kv``): ``"arena"`` (the default) puts the slot's KV pool in the arena
too (``kv_pool.py``, ``kv_hooks/``): worker and shadow map one pool, the idle shadow holds no
second one, and on promotion the shadow adopts the dead worker's in-flight requests with
their KV (``belayer_adopt``), so the router's re-sent ``prompt + generated`` ids are a
prefix-cache hit and only the last token is prefilled. ``"server"``: each server owns its KV,
as below (the shadow's KV resident, or released by the memory saver).

What a shadow does before it waits: a warm-up (short greedy requests, streamed as the
router sends them: every kernel of a prefill and a decode is loaded and compiled, and
SGLang's HTTP side has streamed an answer, so the first request after promotion pays none
of it), then, on a GPU with ``torch_memory_saver`` in SGLang's environment, it
releases its KV cache (``shadow_memory_saver``: None = where available and the KV pool is
over ``RESIDENT_KV_MIB``, True = required, False = off). Its CUDA graphs stay resident (decode, and prefill up to 128 tokens: a
re-prefill of a short request takes the graph path) unless ``shadow_release_graphs``;
promotion then only resumes the KV cache, while the arena is asked whether the shadow is
still registered. Without the saver the shadow keeps its KV resident too, and torch's
allocator uses expandable segments there (``launcher.expandable_segments``): promotion
resumes nothing (the fastest handover, at the KV's size in GPU memory).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from belayer_core.errors import BelayerError, ConfigError, WorkerLost

from .launcher import TP_FLAGS, has_package, inherited_expandable, venv_dir, venv_python
from .sizing import GPU_RUNNING, context_default, flag_value, is_cpu, kv_plan, kv_pool_mib

log = logging.getLogger(__name__)

WARMUP_PROMPT_LENS = (16, 256)  # token ids of two warm-up prompts (prefill kernels at two sizes)
WARMUP_ADOPTED = 4  # then this many one-id extensions of the cached 256 at once (an adoption's continuation)
# Prefill CUDA graphs of a shadow, up to this many tokens. On an H200 (4B shape, resident KV):
# 1,504 MiB with 256, 1,444 with 128, 1,422 with 64, 1,288 without; a 96-id prefill 16-33 ms
# with graphs of >= 128 tokens, 46-67 ms with fewer or none (benchmarks/results/sglang_server_memory_h200_expandable.json).
SHADOW_PREFILL_GRAPH_TOKENS = 128
# A shadow keeps a KV pool up to this size resident where the saver could release it: promotion
# then resumes nothing (H200, 4B, 4,096 tokens = 576 MiB: handover p50 40 ms at 1,288 MiB, vs
# 66-96 ms resuming it); the rest of a shadow is ~712 MiB, so it stays under 1.5 GB.
RESIDENT_KV_MIB = 768
# Per-thread stack of each GPU server's scheduler (0: the driver's 1 KiB). 256 saves ~200 MiB per
# server on an H200 (measured: 1,868 -> 1,670 MiB, same greedy ids); see gpu_hooks/README.md.
DEFAULT_CUDA_STACK_BYTES = 256
ADOPT_TAG = "belayer_adopt:"  # kv_hooks/belayer_kv_state.py (inside the server): adopt that server's journaled requests
SGLANG_TITLE = "sglang::"  # SGLang names its processes so (setproctitle)
PREFILL_GRAPH_FLAGS = ("--cuda-graph-max-bs-prefill", "--piecewise-cuda-graph-max-tokens", "--disable-prefill-cuda-graph")


class SGLangBackend:
    """Start, register, warm, release and promote SGLang servers for the supervisor."""

    name = "sglang"
    isolated_kv = True  # each server owns its KV; weights are read-only to it
    arena_module = "belayer_engine.backends.sglang.arena"  # the arena with SGLang's weight cache

    def __init__(self, model: str | None, extra_args: list[str] | None = None, venv: str | None = None,
                 device: str = "cpu", shadow_memory_saver: bool | None = None,
                 shadow_release_graphs: bool = False, cuda_stack_bytes: int | None = None,
                 kv: str | None = None, kv_tokens: int | None = None, kv_reserve_tokens: int | None = None,
                 kv_fraction: float | None = None) -> None:
        if model is None:
            from .model_dir import embedded_config, ensure_embedded_model

            # SGLang's GPU kernels (RMSNorm, attention) take half precision only.
            model = str(ensure_embedded_model(cfg=None if is_cpu(device) else embedded_config(dtype="bfloat16")))
        self.model = model
        self.venv = venv
        self.extra_args = list(extra_args or [])
        venv_python(venv)  # fail now, naming the set-up script, not after a 3-minute timeout
        if flag_value(self.extra_args, ("--tokenizer-worker-num",)) not in (None, "1"):
            # SGLang exits at start ("API key is not supported in multi-tokenizer mode"), and
            # /update_weight_version reaches one of the HTTP processes only (0.5.17, 0.5.23)
            raise ConfigError("--tokenizer-worker-num: the engine runs one HTTP process per SGLang server; with "
                              "several SGLang refuses the --api-key that carries the engine's worker secret, and "
                              "keeps the weight version per process (a response could name the version before "
                              "an update)")
        self.tp = self._tp(device)
        if kv is None:  # the arena's pool is one rank's: a tensor-parallel group's servers own their KV
            kv = "arena" if self.tp == 1 else "server"
        if kv == "arena" and self.tp > 1:
            raise ConfigError(f"sglang_kv='arena' holds one server's KV pool, not the {self.tp} ranks' of --tp-size "
                              f"{self.tp}: use sglang_kv='server' (the default with --tp-size > 1; the shadow "
                              "re-prefills the in-flight requests instead of adopting their KV)")
        if kv not in ("arena", "server"):
            raise ConfigError(f"sglang_kv must be 'arena' or 'server', not {kv!r}")
        self.kv = kv
        if kv == "arena" and (shadow_memory_saver or shadow_release_graphs):
            raise ConfigError("sglang_shadow_memory_saver / _release_graphs: with sglang_kv='arena' the shadow holds "
                              "no KV pool of its own to release (use sglang_kv='server')")
        if kv == "server" and kv_fraction is not None:
            raise ConfigError("sglang_kv_fraction sizes the arena's pool (sglang_kv='arena'); with 'server' give "
                              "sglang_kv_tokens (a resident shadow holds a second pool of that size)")
        # kv="server" keeps its small default pool: a resident shadow holds a second one.
        self.kv_tokens, self.kv_reserve_tokens = kv_plan(kv_tokens, kv_reserve_tokens, self.extra_args,
                                                         self.model if kv == "arena" else None, device, kv_fraction)
        self.sizes = self._sizes(device) if kv == "arena" else ["--max-total-tokens", str(self.kv_tokens)]
        if kv == "arena":
            shadow_memory_saver = False
        self.shadow_memory_saver = self._saver_wanted(device, shadow_memory_saver)
        if cuda_stack_bytes and is_cpu(device):
            raise ConfigError(f"sglang_cuda_stack_bytes={cuda_stack_bytes} needs a CUDA device; device is cpu")
        self.cuda_stack_bytes = DEFAULT_CUDA_STACK_BYTES if cuda_stack_bytes is None else cuda_stack_bytes
        if shadow_release_graphs and not self.shadow_memory_saver:
            raise ConfigError("sglang_shadow_release_graphs needs the shadow memory saver (a CUDA device with "
                              "torch_memory_saver in SGLang's environment)")
        # The weights belong to the arena: never released.
        self.releasable = ("kv_cache", "cuda_graph") if shadow_release_graphs else ("kv_cache",)
        self._arena_of: dict[str, str] = {}  # worker url -> arena socket
        self._released: set[str] = set()  # shadows whose KV (and graphs) are released

    def _tp(self, device: str) -> int:
        """The servers' tensor-parallel size (``--tp-size`` in ``extra_args``), checked against
        the model now (SGLang would fail each rank minutes later, or hang)."""
        value = flag_value(self.extra_args, TP_FLAGS)
        if value is None:
            return 1
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--tp-size {value!r}: a positive integer is needed")
        tp = int(value)
        if tp == 1:
            return 1
        if flag_value(self.extra_args, ("--pp-size", "--pipeline-parallel-size", "--dp-size", "--data-parallel-size",
                                        "--ep-size", "--expert-parallel-size")) not in (None, "1"):
            raise ConfigError("--tp-size is served; pipeline, data and expert parallel sizes other than 1 are not")
        from belayer_core.errors import UsageError
        from belayer_engine.model.config import ModelConfig

        from .tp_layout import check_tp

        cfg = ModelConfig.from_dir(self.model)
        try:
            check_tp(cfg, tp)
        except UsageError as exc:
            raise ConfigError(f"--tp-size {tp} with {self.model}: {exc}") from None
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        if is_cpu(device) and (heads % tp or kv_heads % tp):
            # SGLang's CPU backend pads the heads then (adjust_config_with_unaligned_cpu_tp);
            # the arena's shards are the unpadded layout (a GPU replicates kv heads instead)
            fits = [n for n in range(1, kv_heads + 1) if not heads % n and not kv_heads % n]
            raise ConfigError(f"--tp-size {tp} on CPU: SGLang's CPU backend pads {heads} attention / {kv_heads} kv "
                              f"heads that do not divide by the tp size, a layout the arena does not serve; use "
                              f"a tp size that divides both ({', '.join(map(str, fits))})")
        if not is_cpu(device):
            log.warning("--tp-size %d on %s: the multi-GPU path is untested (no machine with several GPUs was lent); "
                        "CPU ranks are tested", tp, device)
        return tp

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
        if present and (var := inherited_expandable(os.environ)):
            # The saver releases only what cudaMalloc gave; expandable segments bypass it.
            if wanted:
                raise ConfigError(f"sglang_shadow_memory_saver: {var}={os.environ[var]} turns torch's expandable "
                                  "segments on, whose memory the saver cannot release: unset it, or turn the "
                                  "saver off")
            log.info("shadow memory saver off: %s turns expandable segments on (the shadow keeps its KV)", var)
            return False
        kv_mib = kv_pool_mib(self.model, self.extra_args)
        if present and wanted is None and kv_mib is not None and kv_mib <= RESIDENT_KV_MIB:
            log.info("shadow keeps its %.0f MiB KV pool resident (<= %d MiB): promotion resumes nothing", kv_mib,
                     RESIDENT_KV_MIB)
            return False
        return present

    def _sizes(self, device: str) -> list[str]:
        """SGLang flags for what users run, where ``extra_args`` do not say: on a GPU the
        model's own context (capped at 64K) and 64 running requests; the KV pool always."""
        out = ["--max-total-tokens", str(self.kv_tokens)]
        if not is_cpu(device):
            if flag_value(self.extra_args, ("--context-length",)) is None:
                out += ["--context-length", str(context_default(self.model, device))]
            if flag_value(self.extra_args, ("--max-running-requests",)) is None:
                out += ["--max-running-requests", str(GPU_RUNNING)]
        return out

    @staticmethod
    def weight_cache_socket(slot) -> str:
        return str(Path(slot.run_dir) / f"wcache-{slot.name}.sock")

    def arena_argv(self, slot) -> list[str]:
        # The weights in SGLang's layout only; the KV pool there too (kv="arena") or in each server.
        argv = ["--model-dir", self.model, "--weight-cache-socket", self.weight_cache_socket(slot),
                "--no-reference-slots"]
        if self.kv == "arena":
            argv += ["--kv-pool", "--kv-reserve-tokens", str(self.kv_reserve_tokens)]
        if self.tp > 1:
            argv += ["--tp-size", str(self.tp)]  # the weight cache serves each rank its shard
        return argv

    def worker_argv(self, slot, spec) -> list[str]:
        self._arena_of[f"http://{spec.host}:{spec.port}"] = str(slot.arena_socket)
        argv = ["-m", "belayer_engine.backends.sglang.server", "--model-path", self.model,
                "--host", spec.host, "--port", str(spec.port), "--device", slot.device,
                "--weight-cache-socket", self.weight_cache_socket(slot), "--worker-id", spec.worker_id,
                "--key-dir", str(slot.run_dir)]
        if self.venv:
            argv += ["--venv", self.venv]
        if self.kv == "arena":
            argv += ["--kv-arena", str(slot.arena_socket), "--kv-role", "shadow" if spec.shadow else "worker"]
        if self.cuda_stack_bytes and not is_cpu(slot.device):
            argv += ["--cuda-stack-bytes", str(self.cuda_stack_bytes)]
        if spec.shadow and self.shadow_memory_saver:
            argv.append("--memory-saver")
            if "cuda_graph" in self.releasable:
                argv.append("--memory-saver-graphs")
        if spec.shadow and not is_cpu(slot.device) and "cuda_graph" not in self.releasable \
                and not any(a.startswith(PREFILL_GRAPH_FLAGS) for a in self.extra_args):
            # Prefill CUDA graphs for the re-prefill after a handover, kept small (SGLang's
            # default goes up to the chunked-prefill size, capped at max_total_tokens).
            argv += ["--cuda-graph-max-bs-prefill", str(SHADOW_PREFILL_GRAPH_TOKENS)]
        argv += ["--shadow"] if spec.shadow else []
        return argv + self.sizes + self.extra_args  # the user's flags last: SGLang takes the last of each

    def worker_env(self, base: dict[str, str]) -> dict[str, str]:
        return dict(base)  # server.py builds SGLang's own environment before it execs

    async def _register(self, session, url: str, role: str) -> int:
        """The arena pauses, flushes and re-versions the server on every weight update; it
        gets the worker secret's header for that over its 0600 same-uid socket."""
        from belayer_engine.arena.client import ArenaClient

        client = ArenaClient(self._arena_of[url], timeout=60)
        return await asyncio.to_thread(client.register_server, url, role, 0, session.headers.get("Authorization"))

    async def _warm_up(self, session, url: str, timeout: float = 300) -> None:
        """Short greedy requests on an unrouted shadow: the kernels of its first real requests
        are then loaded and compiled already. Its own KV only. Two prompts (a re-prefill), then
        a few requests that extend a cached prompt by one id at once: what an adopted request's
        continuation runs (a prefix-cache hit of all but its newest id)."""
        prompt = [1 + i % 200 for i in range(max(WARMUP_PROMPT_LENS))]
        for n in WARMUP_PROMPT_LENS:
            await self._warm_request(session, url, prompt[:n], timeout)
        await asyncio.gather(*(self._warm_request(session, url, prompt + [201 + i], timeout)
                               for i in range(WARMUP_ADOPTED)))

    async def _warm_request(self, session, url: str, ids: list[int], timeout: float) -> None:
        import aiohttp

        # Streamed, as the router sends: the first streamed answer of an SGLang server costs
        # ~12 ms more than the next ones (its HTTP side), and must not be the handover's.
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        try:
            async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:  # e.g. a context length under the prompt: warm what fits
                    log.warning("%s: warm-up of %d tokens answered %d: %s", url, len(ids), resp.status,
                                (await resp.text())[:200])
                else:
                    await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise WorkerLost(f"{url} warm-up failed: {exc!r}") from exc

    async def ready(self, session, url: str, shadow: bool) -> bool:
        from belayer_engine.common.net import http_status

        if (await http_status(session, url + "/health"))[0] != 200:
            return False
        if shadow:
            await self._warm_up(session, url)
        await self._register(session, url, "shadow" if shadow else "worker")  # flushes the warm-up's cache
        if shadow and self.shadow_memory_saver:  # idle and unrouted: safe to release
            await self._memory(session, url, "release", timeout=60)
            self._released.add(url)
        return True

    async def _memory(self, session, url: str, action: str, timeout: float, tags: list[str] | None = None) -> None:
        """``/release_memory_occupation`` or ``/resume_memory_occupation`` of what this
        backend releases (or of ``tags``: the KV hook's adoption); WorkerLost when refused."""
        import aiohttp

        try:
            async with session.post(f"{url}/{action}_memory_occupation", json={"tags": tags or list(self.releasable)},
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    raise WorkerLost(f"{url}/{action}_memory_occupation answered {resp.status}: {(await resp.text())[:200]}")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise WorkerLost(f"{url}/{action}_memory_occupation failed: {exc!r}") from exc

    async def promote(self, session, url: str, timeout: float, predecessor: str | None = None) -> float | None:
        """Resume what the shadow released, or adopt the dead worker's requests (kv="arena"),
        while the arena says whether it is still registered (all before anything is routed to
        it); re-sync it if it is not."""
        t0 = time.perf_counter()
        synced = asyncio.create_task(self._synced(url))
        try:
            if self.kv == "arena" and predecessor:
                await self._memory(session, url, "resume", timeout, tags=[ADOPT_TAG + predecessor])
            if url in self._released:
                await self._memory(session, url, "resume", timeout)
                self._released.discard(url)
            registered = await synced
        except BaseException:
            synced.cancel()
            raise
        try:
            if not registered:  # dropped from an update: flush and re-sync first
                if not await self.flush(session, url, timeout):
                    raise WorkerLost(f"promote: {url}/flush_cache refused")
                await self._register(session, url, "worker")
        except BelayerError as exc:
            raise WorkerLost(f"promote: arena refused {url}: {exc}") from exc
        return time.perf_counter() - t0

    async def _synced(self, url: str) -> bool:
        """True while the arena lists the shadow as registered: it then maps the current
        weights and reports the current version (every update synced it), and its cache
        holds nothing but the flushed warm-up, so promotion has nothing left to do."""
        from belayer_engine.arena.client import ArenaClient

        try:
            info = await asyncio.to_thread(ArenaClient(self._arena_of[url], timeout=30).weight_cache)
        except BelayerError as exc:
            raise WorkerLost(f"promote: arena check of {url} failed: {exc}") from exc
        return any(s["url"] == url for s in info.get("servers", []))

    def members(self, pid: int) -> dict[int, str]:
        """SGLang's own processes of the server (``sglang::scheduler_TP<r>``, one per tensor-
        parallel rank, and ``sglang::detokenizer``): a rank SIGKILLed leaves the server up
        and its peers blocked in a collective; the supervisor fences the group at once."""
        from belayer_engine.common.proc_group import group_members

        return {p: title for p, title in group_members(pid).items() if title.startswith(SGLANG_TITLE)}

    async def reaped(self, session, url: str) -> None:
        """The server's process group is gone: its successor may allocate anywhere in the pool
        and its own reserve goes to the next shadow (kv="arena")."""
        arena = self._arena_of.pop(url, None)
        if self.kv != "arena" or arena is None:
            return
        from belayer_engine.arena.client import ArenaClient

        await asyncio.to_thread(ArenaClient(arena, timeout=30).op, "kv_reaped", sid=url)

    async def healthy(self, session, url: str, timeout: float) -> bool:
        import aiohttp

        from belayer_engine.common.net import http_status

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
