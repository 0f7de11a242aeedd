"""The ``belayer`` command line. Each subcommand is a module with ``add_parser(subparsers)``.

Subcommand modules are imported lazily by name, so a missing optional dependency of one
(torch for ``serve``) never breaks the others (``doctor`` must work on a half-set-up box).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from belayer_core import __version__
from belayer_core.errors import BelayerError, InfraError, UsageError

SUBCOMMANDS = ["demo", "doctor", "gc", "checkpoints", "consistency", "serve"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INFRA = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="belayer",
        description="Fault tolerance for LLM agentic RL: recoverable sandboxes and inference engine.",
        epilog="Exit codes: 0 ok, 1 check/run failed, 2 usage error, 3 infrastructure error.",
    )
    parser.add_argument("--version", action="version", version=f"belayer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"belayer.cli.{name}")
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("belayer.cli"):
                _add_unavailable(sub, name, e)
            continue
        module.add_parser(sub)
    return parser


def _add_unavailable(sub: argparse._SubParsersAction, name: str, err: ModuleNotFoundError) -> None:
    p = sub.add_parser(name, help=f"(unavailable: missing {err.name}; pip install 'belayer[all]')")

    def run(_args: argparse.Namespace) -> int:
        print(f"belayer {name}: needs the Python package {err.name!r}: pip install 'belayer[all]'", file=sys.stderr)
        return EXIT_USAGE

    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"belayer {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except InfraError as e:
        print(f"belayer {args.command}: infrastructure error ({type(e).__name__}): {e}", file=sys.stderr)
        return EXIT_INFRA
    except BelayerError as e:
        print(f"belayer {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:  # e.g. a store path that cannot be read: one line, not a traceback
        print(f"belayer {args.command}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"belayer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
