"""Command-line flags derived from a pydantic config: one source of names, defaults and help.

``ConfigFlags(RouterConfig).add_to(parser)`` adds ``--stall-timeout-s`` for the field
``stall_timeout_s``, with the field's description and default as its help; after parsing,
``.build(args)`` validates the given values into a ``RouterConfig``. Flags left out keep
the model's own defaults (nothing is copied into argparse), so the model stays the only
place where a default lives. Nested models become prefixed flags (``faults.env_rate`` ->
``--faults-env-rate``). Torch-free and CLI-free, so any module may use it.

Types: ``bool`` -> ``--x/--no-x``; ``Literal``/``Enum`` -> choices; ``list[T]`` -> zero or
more values, repeatable (``--x`` alone gives an empty list; a value that starts with ``-``
is written ``--x=-value``); ``T | None`` -> ``none`` gives ``None`` (unless ``T`` is
``str``); ``int``/``float``/``str``/``Path`` as such. Other types must be excluded.
Values are validated by the model: an invalid one raises ``UsageError`` naming its flag.
"""

from __future__ import annotations

import argparse
import enum
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from belayer_core.errors import UsageError

_SCALARS = (int, float, str, Path)


class ConfigFlags:
    """The flags of one pydantic model (and its nested models) on an argparse parser.

    ``exclude``: dotted field paths that get no flag (set by the command, or not for users).
    ``defaults``: a different default for this command only (e.g. a server's usual port);
    it shows in the help and applies when the flag is not given.
    ``prefix``: prepended to every flag name (``prefix="router"`` -> ``--router-port``).
    """

    def __init__(self, model: type[BaseModel], *, exclude: Iterable[str] = (),
                 defaults: Mapping[str, Any] | None = None, prefix: str = "", title: str | None = None):
        self.model = model
        self.exclude = set(exclude)
        self.defaults = dict(defaults or {})
        self.prefix = prefix
        self.title = title
        self._dest_prefix = f"{model.__module__}.{model.__qualname__}:"
        self._fields: dict[str, tuple[str, Any]] = {}  # dotted path -> (flag, FieldInfo)
        self._collect(model, "")
        for path in self.exclude | set(self.defaults):
            if not self._known(path):
                raise ValueError(f"{model.__name__} has no field {path!r}")

    # ------------------------------------------------------------------ parser side

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """Add one option per field (inside an argument group when ``title`` is set)."""
        target = parser.add_argument_group(self.title) if self.title and hasattr(parser, "add_argument_group") else parser
        for path, (flag, info) in self._fields.items():
            target.add_argument(flag, dest=self._dest_prefix + path, default=argparse.SUPPRESS,
                                help=self._help(path, info), **_argparse_kind(path, info.annotation))

    def build(self, args: argparse.Namespace, **fixed: Any) -> BaseModel:
        """The model from the given flags, this command's ``defaults`` and ``fixed`` values
        (top-level fields the command sets itself). Invalid values raise ``UsageError``."""
        data: dict[str, Any] = {}
        for path, value in self.defaults.items():
            _put(data, path, value)
        for path, (_, info) in self._fields.items():
            dest = self._dest_prefix + path
            if hasattr(args, dest):
                _put(data, path, _none_word(getattr(args, dest), info.annotation))
        data.update(fixed)
        try:
            return self.model.model_validate(data)
        except ValidationError as exc:
            raise UsageError("; ".join(self._describe(err) for err in exc.errors())) from None

    def flag(self, path: str) -> str:
        """The option string of a dotted field path (for messages and docs)."""
        return self._fields[path][0]

    # ------------------------------------------------------------------ internals

    def _collect(self, model: type[BaseModel], base: str) -> None:
        for name, info in model.model_fields.items():
            path = f"{base}{name}"
            if path in self.exclude:
                continue
            nested = _plain(info.annotation)
            if isinstance(nested, type) and issubclass(nested, BaseModel):
                self._collect(nested, path + ".")
                continue
            parts = ([self.prefix] if self.prefix else []) + path.split(".")
            self._fields[path] = ("--" + "-".join(parts).replace("_", "-"), info)

    def _known(self, path: str) -> bool:
        model: Any = self.model
        for part in path.split("."):
            fields = getattr(model, "model_fields", None)
            if not fields or part not in fields:
                return False
            model = _plain(fields[part].annotation)
        return True

    def _help(self, path: str, info) -> str:
        text = (info.description or "").strip().replace("%", "%%")
        if path in self.defaults:
            default = self.defaults[path]
        elif info.default_factory is not None:
            default = info.default_factory()
        elif info.is_required():
            return f"{text} (required)".strip()
        else:
            default = info.default
        if isinstance(default, enum.Enum):
            default = default.value
        if isinstance(default, list):
            shown = " ".join(map(str, default)) or "(none)"
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".strip()

    def _describe(self, err: dict) -> str:
        loc = [str(p) for p in err.get("loc", ())]
        while loc and ".".join(loc) not in self._fields:
            loc.pop()  # an item of a list field: name the list's flag
        where = self._fields[".".join(loc)][0] if loc else self.model.__name__
        got = err.get("input")
        shown = f" (got {got!r})" if loc and not isinstance(got, dict) else ""
        return f"{where}: {err.get('msg', 'invalid')}{shown}"


def _plain(annotation: Any) -> Any:
    """``T`` of ``T | None``; the annotation itself otherwise."""
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _optional(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


def _none_word(value: Any, annotation: Any) -> Any:
    """``none`` means ``None`` for an optional non-string field."""
    if (isinstance(value, str) and value.lower() in ("none", "null") and _optional(annotation)
            and _plain(annotation) is not str):
        return None
    return value


def _argparse_kind(path: str, annotation: Any) -> dict[str, Any]:
    kind = _plain(annotation)
    origin = get_origin(kind)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        choices = get_args(kind)
        return {"choices": choices, "type": type(choices[0])}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return {"choices": [m.value for m in kind], "type": type(next(iter(kind)).value)}
    if origin in (list, tuple, set, frozenset):
        item = (get_args(kind) or (str,))[0]
        if item not in _SCALARS and get_origin(item) is not Literal:
            raise TypeError(f"field {path!r}: no flag for a list of {item!r}; exclude it")
        return {"action": "extend", "nargs": "*", "metavar": _metavar(item)}
    if kind in _SCALARS:
        return {"metavar": _metavar(kind)}
    raise TypeError(f"field {path!r}: no flag for type {annotation!r}; exclude it")


def _metavar(kind: Any) -> str:
    if get_origin(kind) is Literal:
        return "{" + ",".join(map(str, get_args(kind))) + "}"
    return {int: "N", float: "X", Path: "PATH"}.get(kind, "TEXT")


def _put(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value
