"""``belayer serve <target>``: run one engine process in the foreground.

Each target is one row of ``TARGETS``: its flags and its ``run(args) -> int``. A target's
flags are added when that target is used (parsed or its help shown): they may come from a
config whose package needs torch or aiohttp, which building the whole CLI must not import.
A new target (e.g. the router) is one more row.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (flags "module:function", runner "module:function", help)
TARGETS: dict[str, tuple[str, str, str]] = {
    "arena": ("belayer_engine.backends.sglang.arena:add_flags", "belayer_engine.backends.sglang.arena:run",
              "arena server: owns the weights and KV memory of one device"),
    "worker": ("belayer_engine.backends.reference.config:add_flags", "belayer_engine.backends.reference.worker:run",
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


class _TargetParser(argparse.ArgumentParser):
    """A target's parser; ``add_flags(self)`` runs on first use, not when the CLI is built."""

    def __init__(self, *args, add_flags: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self._add_flags = add_flags

    def _with_flags(self) -> None:
        if self._add_flags:
            ref, self._add_flags = self._add_flags, ""
            try:
                _resolve(ref)(self)
            except ModuleNotFoundError as exc:  # e.g. aiohttp without belayer[engine]
                self.error(f"needs the Python package {exc.name!r}: pip install 'belayer[all]'")

    def parse_known_args(self, args=None, namespace=None):
        self._with_flags()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._with_flags()
        return super().format_help()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run an engine process (arena, worker, ...)",
                              description=__doc__)
    sub = p.add_subparsers(dest="serve_target", metavar="TARGET", required=True, parser_class=_TargetParser)
    for name, (flags, runner, help_text) in TARGETS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text, add_flags=flags)
        sp.set_defaults(serve_runner=runner)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return int(_resolve(args.serve_runner)(args) or 0)
