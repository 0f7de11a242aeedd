"""``python -m belayer_engine.backends.sglang.server``: start one SGLang server as a worker.

Runs in the project's interpreter (torch-free, fast) and replaces itself (``execve``)
with SGLang's ``launch_server`` in SGLang's own venv, so the process the supervisor
spawned, fences and reaps is the SGLang server itself (same pid, same process group).
A shadow is the same server: it is kept out of the routing table until promoted.

The engine's worker secret (``BELAYER_WORKER_SECRET``, inherited, never on argv) becomes
SGLang's ``--api-key`` through a 0600 YAML file given with ``--config`` (SGLang merges it
into its arguments in-process), so ``/proc/PID/cmdline`` never shows it and the server
answers only the router, the supervisor and the arena.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from belayer_engine.common import worker_auth

from .launcher import SGLangServerConfig, server_argv, server_env


def parse(argv: list[str] | None = None) -> SGLangServerConfig:
    p = argparse.ArgumentParser(prog="python -m belayer_engine.backends.sglang.server", description=__doc__,
                                allow_abbrev=False)  # unknown flags go to SGLang whole, never abbreviations of ours
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--weight-cache-socket", default=None)
    p.add_argument("--venv", default=None)
    p.add_argument("--worker-id", default=None, help="for the supervisor's logs only")
    p.add_argument("--shadow", action="store_true", help="a shadow is a started server (on CPU: its ranks' cores)")
    p.add_argument("--key-dir", default=None, help="where the 0600 api-key file goes (default: $TMPDIR)")
    p.add_argument("--memory-saver", action="store_true", help="GPU: the KV cache is releasable (shadows)")
    p.add_argument("--memory-saver-graphs", action="store_true", help="with --memory-saver: CUDA graphs too")
    p.add_argument("--kv-arena", default=None, help="the arena's control socket: the KV pool is the arena's")
    p.add_argument("--kv-role", default="worker", choices=("worker", "shadow"), help="with --kv-arena")
    p.add_argument("--cuda-stack-bytes", type=int, default=0,
                   help="GPU: the scheduler's CUDA per-thread stack limit once built (0: the driver's default)")
    args, extra = p.parse_known_args(argv)
    secret = worker_auth.take_from_env()
    if secret:
        fd, path = tempfile.mkstemp(prefix="sglang-key-", suffix=".yaml", dir=args.key_dir)  # mode 0600
        with os.fdopen(fd, "w") as fh:
            fh.write(f"api-key: {json.dumps(secret)}\n")
        extra = [*extra, "--config", path]
    return SGLangServerConfig(model_path=args.model_path, host=args.host, port=args.port, device=args.device,
                              weight_cache_socket=args.weight_cache_socket, venv=args.venv,
                              memory_saver=args.memory_saver,
                              memory_saver_graphs=args.memory_saver_graphs,
                              cuda_stack_bytes=args.cuda_stack_bytes, kv_arena=args.kv_arena,
                              kv_role=args.kv_role, shadow=args.shadow, extra_args=extra)


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    argv_ = server_argv(cfg)
    os.execve(argv_[0], argv_, server_env(cfg))
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
