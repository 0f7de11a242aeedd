"""The house rules of issue 34, checked on every module: no import circle anywhere (module
level, lazy and type-checking imports included), no module over 400 lines, and the shared
base below both halves with the CLI above them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_boundaries import ROOT, _imports, _module_name, _under

CORE = ["belayer_core", "belayer", "belayer_env", "belayer_engine"]
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in CORE:
        for path in sorted((ROOT / package).rglob("*.py")):
            out[_module_name(path)] = path
    return out


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Edges between our own modules: ``from a.b import c`` points at module ``a.b.c`` when
    ``c`` is a module, else at ``a.b``; importing a package's module also runs its
    ``__init__``, which is not an edge of ours (an ``__init__`` of docstrings imports
    nothing)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_circle_anywhere() -> None:
    cycles = _cycles(_graph(_modules()))
    assert not cycles, "import circles (break them; see shared/DESIGN.md, 'Boundaries'):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_the_circle_check_finds_a_lazy_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_over_400_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them by role):\n" + "\n".join(long)


@pytest.mark.parametrize("half", ["belayer_env", "belayer_engine"])
def test_the_halves_import_the_base_not_the_cli_package(half: str) -> None:
    """``belayer`` is the command line (above both halves); the base is ``belayer_core``."""
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in sorted((ROOT / half).rglob("*.py"))
           for n in _imports(p) if _under(n, "belayer")]
    assert not bad, "\n".join(bad)


def test_the_base_imports_nothing_of_ours_above_it() -> None:
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in sorted((ROOT / "belayer_core").rglob("*.py"))
           for n in _imports(p) if any(_under(n, pkg) for pkg in CORE[1:] + ["wrappers", "examples"])]
    assert not bad, "\n".join(bad)


def test_the_env_half_has_no_loose_modules_but_its_base() -> None:
    """Every module of ``belayer_env`` sits in a folder named for its part, except the package's
    own entry points (what every part uses is in ``common/``)."""
    loose = sorted(p.name for p in (ROOT / "belayer_env").glob("*.py"))
    assert loose == ["__init__.py", "registration.py"]


def test_the_engine_half_has_no_loose_modules_but_its_front_door() -> None:
    """``RecoverableEngine`` and what it is built from; every part is a folder."""
    loose = sorted(p.name for p in (ROOT / "belayer_engine").glob("*.py"))
    assert loose == ["__init__.py", "client.py", "engine.py", "lifecycle.py"]


def _packages(graph: dict[str, set[str]], modules: dict[str, Path]) -> dict[str, set[str]]:
    """The same edges between folders: each module belongs to the package of its folder (a
    package's ``__init__`` to that package)."""
    def folder(name: str) -> str:
        return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]

    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        here = folder(name)
        out.setdefault(here, set()).update(folder(t) for t in targets if folder(t) != here)
    return out


def test_no_import_circle_between_packages() -> None:
    """Layers, not a web: no folder imports (through any module) a folder that imports it
    back, e.g. a backend that imports the supervisor while the supervisor starts backends."""
    modules = _modules()
    cycles = _cycles(_packages(_graph(modules), modules))
    assert not cycles, "import circles between packages (move the shared part below both):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_the_package_circle_check_sees_a_back_arrow() -> None:
    modules = {"p.a": Path("p/a.py"), "p.q.b": Path("p/q/b.py"), "p.r.c": Path("p/r/c.py")}
    up = {"p.a": {"p.q.b"}, "p.q.b": {"p.r.c"}, "p.r.c": {"p.a"}}
    assert _cycles(_packages(up, modules)) == [["p", "p.q", "p.r"]]
    down = {"p.a": {"p.q.b"}, "p.q.b": {"p.r.c"}, "p.r.c": set()}
    assert _cycles(_packages(down, modules)) == []
