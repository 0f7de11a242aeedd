"""Every python snippet in README.md and docs/ compiles and imports only names that exist, and
every repository path the docs name (``belayer_env/...py``, ``benchmarks/...``) is there.

The snippets that need a live engine or sandboxes run in their own tests (docs/training.md's
``rollout_one``: tests/examples/test_docs_training.py); this one catches what a move of
modules, a rename or a deleted benchmark breaks, in seconds and without Docker.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _snippets() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"```python\n(.*?)```", text, re.DOTALL):
            out.append((page.relative_to(ROOT).as_posix(), text[: m.start()].count("\n") + 2, m.group(1)))
    return out


SNIPPETS = _snippets()


@pytest.mark.parametrize(("page", "line", "source"), SNIPPETS, ids=[f"{p}:{n}" for p, n, _ in SNIPPETS])
def test_snippet_compiles_and_its_imports_resolve(page: str, line: int, source: str) -> None:
    tree = ast.parse(compile(source, f"{page}:{line}", "exec", ast.PyCF_ONLY_AST))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule, else ImportError


def test_the_docs_have_snippets() -> None:
    assert len(SNIPPETS) >= 10, SNIPPETS


PATH = re.compile(r"(?<![\w/.-])((?:belayer_core|belayer_env|belayer_engine|belayer|benchmarks|wrappers|examples|"
                  r"scripts|tests)/[\w./{},-]*[\w}])")


def _expand(path: str) -> list[str]:
    """``results/x.{json,png}`` -> both; ``weights_{endpoint,client}.py`` -> both."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[: m.start()] + alt + path[m.end():])]


def test_paths_the_docs_name_exist() -> None:
    missing = []
    for page in PAGES:
        for raw in PATH.findall(page.read_text()):
            for path in _expand(raw.rstrip(".,")):
                if "<" in path or "*" in path or re.fullmatch(r"belayer/\w+-v\d+", path):  # an env id
                    continue
                if not (ROOT / path).exists():
                    missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


DOTTED = re.compile(r"`((?:belayer_core|belayer_env|belayer_engine|belayer)(?:\.\w+)+)")
# not modules: a response's `belayer` extension (`belayer.recoveries`) and container labels (`belayer.sandbox=`)
NOT_MODULES = {"belayer.weight_version", "belayer.recoveries", "belayer.choices", "belayer.diverged",
               "belayer.sandbox", "belayer.shared"}


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_dotted_names_the_docs_show_resolve() -> None:
    """``belayer_env.env.rewards``, ``belayer.wrappers.ChatHistory``, ``belayer_core.procfs.OwnerId``:
    a module path or a module's attribute, as the docs show it to users."""
    missing = sorted({f"{page.relative_to(ROOT)}: {name}" for page in PAGES
                      for name in DOTTED.findall(page.read_text())
                      if name not in NOT_MODULES and not _resolves(name)})
    assert not missing, "\n".join(missing)
