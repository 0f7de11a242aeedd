"""The boundaries of shared/DESIGN.md, checked on every import statement (top level or not).

- belayer_env and belayer_engine never import each other; the core (both halves and the
  shared base) never imports belayer.wrappers, belayer.examples or the CLI.
- The router reaches workers only over HTTP: it imports no backend, arena or supervisor code.
- The supervisor knows workers only through ``backends.base`` and each backend's launcher.
- Backends never import the router or the supervisor's recovery logic.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, node.module] if node.module else base)
            out.add(mod)
            out.update(f"{mod}.{alias.name}" for alias in node.names)
    return out


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


CORE_FORBIDDEN = ["belayer.cli", "belayer.wrappers", "belayer.examples"]

RULES = [
    ("belayer_env", ["belayer_engine", *CORE_FORBIDDEN], []),
    ("belayer_engine", ["belayer_env", *CORE_FORBIDDEN], []),
    ("belayer_engine.router", ["belayer_engine.backends", "belayer_engine.arena", "belayer_engine.supervisor",
                               "belayer_engine.engine", "torch"], []),
    ("belayer_engine.supervisor", ["belayer_engine.backends", "belayer_engine.router", "torch"],
     ["belayer_engine.backends.base", "belayer_engine.backends.reference.launcher",
      "belayer_engine.backends.sglang.launcher", "belayer_engine.backends.sglang.backend"]),
    ("belayer_engine.backends", ["belayer_engine.router", "belayer_engine.engine",
                                 "belayer_engine.supervisor.supervisor", "belayer_engine.supervisor.slot"], []),
]


@pytest.mark.parametrize(("package", "forbidden", "allowed"), RULES, ids=[r[0] for r in RULES])
def test_package_boundaries(package: str, forbidden: list[str], allowed: list[str]) -> None:
    bad = []
    for path in _sources(package):
        for name in sorted(_imports(path)):
            if any(_under(name, a) for a in allowed):
                continue
            if any(_under(name, f) for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "boundary broken (see shared/DESIGN.md, 'Boundaries'):\n" + "\n".join(bad)


def test_shared_core_imports_neither_half() -> None:
    shared = sorted(ROOT.joinpath("belayer_core").rglob("*.py"))
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in shared
           for n in _imports(p) if any(_under(n, f) for f in ["belayer_env", "belayer_engine", *CORE_FORBIDDEN])]
    assert not bad, "\n".join(bad)


def test_the_check_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    src = "def f():\n    from ..router import app\n    import belayer_env.sandbox.container\n"
    path = ROOT / "belayer_engine" / "supervisor" / "_probe_for_test.py"
    path.write_text(src)
    try:
        names = _imports(path)
    finally:
        path.unlink()
    assert "belayer_engine.router.app" in names and "belayer_env.sandbox.container" in names
