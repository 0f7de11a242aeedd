"""Command-line flags of the arena and the worker, importable without torch or aiohttp.

Shared by ``python -m belayer_engine.{arena,worker}`` and ``belayer serve {arena,worker}``,
so building the ``belayer`` parser stays fast.
"""

from __future__ import annotations

import argparse


def arena(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", required=True, help="Unix socket path of the control channel")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--model-dir", default=None, help="HF-layout dir; default: seeded weights")
    p.add_argument("--preset", default="small", choices=["small", "qwen3-4b"],
                   help="shape of seeded weights when --model-dir is not given")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated weights")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks in the live arena")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--scratch-blocks", type=int, default=8, help="KV blocks for shadows")
    p.add_argument("--ack-timeout-s", type=float, default=30.0,
                   help="update_weights waits this long for every worker to switch")
    p.add_argument("--lease-wait-s", type=float, default=2.0,
                   help="activation waits this long for the old worker's connection to close")
    p.add_argument("--weight-cache-socket", default=None,
                   help="also serve SGLang's weight-cache protocol on this Unix socket")


def worker(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arena-socket", required=True, help="control socket of the arena server")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    p.add_argument("--shadow", action="store_true", help="start as a pre-initialized shadow")
    p.add_argument("--worker-id", default=None, help="name reported in /belayer/state")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (fixed: part of exact CPU numerics)")
    p.add_argument("--max-running", type=int, default=32, help="requests decoded together")
    p.add_argument("--max-prefill-tokens", type=int, default=1024,
                   help="prompt tokens admitted per scheduler step")
    p.add_argument("--tokenizer-dir", default=None, help="dir with tokenizer.json")
    p.add_argument("--hang-timeout-s", type=float, default=None,
                   help="/health fails once one scheduler step takes longer (default 60)")
