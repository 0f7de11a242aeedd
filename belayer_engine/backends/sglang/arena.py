"""The arena of an SGLang slot: the arena process with SGLang's exports plugged in.

``python -m belayer_engine.backends.sglang.arena`` takes every flag of the plain arena
(``belayer_engine.arena.config``), ``--weight-cache-socket PATH`` (the weights are then also
served in SGLang's layout over SGLang's weight-cache protocol, ``weight_cache.py``, so every
SGLang worker and shadow of the slot maps one copy) and ``--kv-pool`` (the slot's KV pool
lives here too, ``kv_pool.py``: a dead server's KV survives it and its shadow adopts it).
``belayer serve arena`` runs this entry point. The arena itself never imports a backend: it
is handed the exports.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import Field

from belayer_core.config_flags import ConfigFlags
from belayer_core.errors import ConfigError
from belayer_engine.arena.config import ArenaConfig
from belayer_engine.arena.exports import ArenaExport, ExportContext, ExportFactory
from belayer_engine.arena.server import serve
from belayer_engine.backends.sglang.kv_pool import KvPoolExport
from belayer_engine.backends.sglang.weight_cache import WeightCacheExport


class SGLangArenaConfig(ArenaConfig):
    """The arena's options and what SGLang's workers map from it."""

    weight_cache_socket: str | None = Field(None, description="also serve SGLang's weight-cache protocol on this Unix socket")
    tp_size: int = Field(1, ge=1, description="the SGLang servers' tensor-parallel size: the weight cache serves "
                         "each rank its shard")
    kv_pool: bool = Field(False, description="hold the SGLang servers' KV pool, request tables and journals (adoption)")
    kv_reserve_tokens: int = Field(1024, ge=1, description="with --kv-pool: KV slots the serving worker never "
                                   "allocates (its shadow's warm-up, and the promoted shadow's first allocations)")


FLAGS = ConfigFlags(SGLangArenaConfig)


def add_flags(parser: argparse.ArgumentParser) -> None:
    FLAGS.add_to(parser)


def exports(cfg: SGLangArenaConfig) -> list[ExportFactory]:
    """What the arena serves for SGLang beside its own regions."""
    out: list[ExportFactory] = []
    if cfg.weight_cache_socket:
        socket_path, tp = cfg.weight_cache_socket, cfg.tp_size

        def weight_cache(ctx: ExportContext) -> ArenaExport:
            return WeightCacheExport(ctx.model, ctx.weights, socket_path, ctx.device, tp_size=tp)

        out.append(weight_cache)
    if cfg.kv_pool:
        if cfg.tp_size != 1:
            raise ConfigError(f"--kv-pool holds one rank's KV; tp_size {cfg.tp_size} servers own their KV")
        reserve = cfg.kv_reserve_tokens

        def kv_pool(ctx: ExportContext) -> ArenaExport:
            return KvPoolExport(ctx, reserve)

        out.append(kv_pool)
    return out


def run(args: argparse.Namespace) -> int:
    cfg = FLAGS.build(args)
    return serve(cfg, exports(cfg))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m belayer_engine.backends.sglang.arena", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
