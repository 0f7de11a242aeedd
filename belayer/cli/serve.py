"""``belayer serve <target>``: run one engine process in the foreground.

Each target is one row of ``TARGETS``: its flags come from a light module (no torch at
parser build time) and its ``run(args) -> int`` from the module that does the work. A new
target (e.g. the router) is one more row.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (flags "module:function", runner "module:function", help)
TARGETS: dict[str, tuple[str, str, str]] = {
    "arena": ("belayer_engine.cli_args:arena", "belayer_engine.arena:run",
              "arena server: owns the weights and KV memory of one device"),
    "worker": ("belayer_engine.cli_args:worker", "belayer_engine.worker:run",
               "reference inference worker (SGLang /generate protocol)"),
}


def _register_engine_targets() -> None:
    """The router helper's rows (``engine``, ``router``) live in ``serve_engine.py``."""
    from belayer.cli.serve_engine import TARGET_ROWS

    TARGETS.update(TARGET_ROWS)


_register_engine_targets()


def _resolve(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run an engine process (arena, worker, ...)",
                              description=__doc__)
    sub = p.add_subparsers(dest="serve_target", metavar="TARGET", required=True)
    for name, (flags, runner, help_text) in TARGETS.items():
        try:  # flags come from the target's config, whose package may need an optional extra
            add_flags = _resolve(flags)
            sp = sub.add_parser(name, help=help_text, description=help_text)
            add_flags(sp)
        except ModuleNotFoundError as exc:  # e.g. aiohttp without belayer[engine]
            sp = sub.add_parser(name, help=f"(unavailable: missing {exc.name}; pip install 'belayer[all]')")
            sp.set_defaults(serve_missing=exc.name)
        sp.set_defaults(serve_runner=runner)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from belayer.errors import UsageError

    if getattr(args, "serve_missing", None):
        raise UsageError(f"needs the Python package {args.serve_missing!r}: pip install 'belayer[all]'")
    return int(_resolve(args.serve_runner)(args) or 0)
