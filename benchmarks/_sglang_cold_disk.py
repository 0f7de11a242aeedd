"""The baseline without Belayer (``engine_handover.py --modes cold-disk``): one plain SGLang
server that loads its weights from disk; SIGKILL its process group mid-stream, start a new
one, re-send the rest of the request. Kill -> first token of the re-sent request is all a
user without a shadow can get."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import _procmem as procmem  # benchmarks/, on sys.path when run as a script
from _handover_common import PROMPT


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 900) -> None:
    """Until the plain server at ``url`` answers /health (RuntimeError if it exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"SGLang server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"SGLang server at {url} not healthy after {timeout:.0f}s")


def measure_cold_disk(args, rng: random.Random) -> list[dict]:
    """``args.repeats`` kills of a plain server (``args``: engine_handover's options)."""
    from belayer_engine.backends.sglang.launcher import SGLangServerConfig, server_argv, server_env
    from belayer_engine.backends.sglang.model_dir import ensure_embedded_model
    from belayer_engine.common.net import free_port

    model = args.model_dir or str(ensure_embedded_model())
    runs = []

    def start() -> tuple[subprocess.Popen, str]:
        cfg = SGLangServerConfig(model_path=model, port=free_port(), device=args.device, venv=args.sglang_venv)
        log = open(Path(args.out) / f"cold_disk_server_{cfg.port}.log", "wb")  # noqa: SIM115 - closed with the server
        proc = subprocess.Popen(server_argv(cfg), env=server_env(cfg), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        return proc, f"http://127.0.0.1:{cfg.port}"

    def stream(url: str, max_tokens: int):
        body = json.dumps({"text": PROMPT, "stream": True, "sampling_params": {
            "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}).encode()
        req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as resp:
            for line in resp:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    yield json.loads(line[6:])

    proc, url = start()
    try:
        wait_healthy(proc, url)
        next(iter(stream(url, 8)))  # one request, as the engine's worker has served before it is measured
        plain_gpu = procmem.tree_gpu_mib(procmem.gpu_mib(), proc.pid)
        print("cold-disk server GPU MiB", plain_gpu, flush=True)
        for _ in range(args.repeats):
            kill_at = rng.randint(args.max_tokens // 4, args.max_tokens // 2)
            got = 0
            try:
                for chunk in stream(url, args.max_tokens):
                    got = len(chunk.get("output_ids") or [])
                    if got >= kill_at:
                        t_kill = time.monotonic()
                        os.killpg(proc.pid, signal.SIGKILL)
                        break
            except OSError:
                pass
            proc.wait()
            proc, url = start()
            wait_healthy(proc, url)
            t_healthy = time.monotonic()
            first = next(iter(stream(url, args.max_tokens - got)))
            t_first = time.monotonic()
            runs.append({"kill_at_client_token": kill_at, "failure_at_token": got,
                         "kill_to_first_token_s": t_first - t_kill, "detection_s": None,
                         "handover_path": "cold-disk", "restart_to_healthy_s": t_healthy - t_kill,
                         "supervisor_handover_s": None, "routed_to_first_token_s": t_first - t_healthy,
                         "breakdown": {"restart_s": t_healthy - t_kill, "first_chunk_s": t_first - t_healthy},
                         "first_ids": len(first.get("output_ids") or []), "plain_server_gpu_mib": plain_gpu})
            print("cold-disk", json.dumps(runs[-1]), flush=True)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return runs
