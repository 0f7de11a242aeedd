"""Every python snippet in README.md and docs/ compiles and imports only names that exist,
every repository path and module the docs name is there, and every snippet of the README and
the env half's pages that is whole (no name left for the reader to fill in, such as
``my_agent``) runs as written against the real Docker engine and CRIU.

docs/training.md's ``rollout_one`` runs in tests/belayer/examples/test_docs_training.py (a container
killed under it); the path and import checks catch what a move of modules, a rename or a
deleted benchmark breaks, in seconds and without Docker.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import os
import re
import subprocess
import symtable
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _snippets() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE):  # fences at line starts
            out.append((page.relative_to(ROOT).as_posix(), text[: m.start()].count("\n") + 2, m.group(1)))
    return out


SNIPPETS = _snippets()


@pytest.mark.parametrize(("page", "line", "source"), SNIPPETS, ids=[f"{p}:{n}" for p, n, _ in SNIPPETS])
def test_snippet_compiles_and_its_imports_resolve(page: str, line: int, source: str) -> None:
    # a block cut from a function body (docs/training.md shows its tests' code) keeps its indent
    tree = ast.parse(compile(textwrap.dedent(source), f"{page}:{line}", "exec", ast.PyCF_ONLY_AST))
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
                if page.name == "training.md" and re.fullmatch(r"belayer/dropped_\w+", path):  # a metric
                    continue
                if not (ROOT / path).exists():
                    missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


SHORT_MODULE = re.compile(r"`((?:\.\./)*\w[\w{},]*(?:/[\w{},.]+)*\.py)\b")
# files of another project's repository: the page names the repository just before the path
EXTERNAL = {"slime/agent/sandbox.py": "THUDM/slime"}


def test_modules_the_docs_name_by_a_short_path_exist() -> None:
    """``arena/server.py`` in a table of belayer_engine, ``test_scratch.py`` beside its tests:
    some file of the repository ends so (a module that moved leaves the name dead)."""
    files = {path.relative_to(ROOT).as_posix() for folder in [*DOCUMENTED, "tests", "scripts"]
             for path in (ROOT / folder).rglob("*.py")}
    missing = []
    for page in PAGES:
        text = page.read_text()
        for m in SHORT_MODULE.finditer(text):
            for path in _expand(m.group(1)):
                if path in EXTERNAL:
                    if EXTERNAL[path] not in text[max(0, m.start() - 200):m.start()]:
                        missing.append(f"{page.relative_to(ROOT)}: {path} (name {EXTERNAL[path]} before it)")
                elif path.startswith("../") or not any(f == path or f.endswith("/" + path) for f in files):
                    missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


DOTTED = re.compile(r"`((?:belayer_core|belayer_env|belayer_engine|belayer)(?:\.\w+)+)")
# not modules: a response's `belayer` extension (`belayer.recoveries`) and container labels (`belayer.sandbox=`)
NOT_MODULES = {"belayer.weight_version", "belayer.recoveries", "belayer.choices", "belayer.diverged",
               "belayer.sandbox", "belayer.shared", "belayer.yaml", "belayer.adopted_tokens"}  # ... and slime's config file


def _defined_in_source(module: str, attr: str) -> bool:
    """A module whose trainer (AReaL, slime) lives in its own venv: its file defines the name."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.is_file():
        return False
    tree = ast.parse(path.read_text())
    return any(getattr(node, "name", None) == attr for node in tree.body)


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("belayer") and i == len(parts) - 1:
                return _defined_in_source(".".join(parts[:i]), parts[i])
            continue
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


ARCHITECTURE = ROOT / "docs" / "architecture.md"
DOCUMENTED = ["belayer_core", "belayer_env", "belayer_engine", "belayer", "benchmarks"]


def _package_modules() -> set[str]:
    """Every module of the packages (``__init__.py`` only re-exports: left out)."""
    return {path.relative_to(ROOT).as_posix() for package in DOCUMENTED for path in (ROOT / package).rglob("*.py")
            if path.name != "__init__.py" and "__pycache__" not in path.parts}


def _architecture_tree() -> dict[str, str]:
    """``path -> role`` of each line of architecture.md's module trees: the ``text`` blocks
    whose first line is a package (``belayer_env/``); a level is two more spaces."""
    listed: dict[str, str] = {}
    for block in re.findall(r"^```text\n(.*?)^```", ARCHITECTURE.read_text(), re.DOTALL | re.MULTILINE):
        lines = block.splitlines()
        if not lines or lines[0].rstrip("/") not in DOCUMENTED:
            continue
        folders: list[str] = []
        for line in lines:
            indent = len(line) - len(line.lstrip(" "))
            assert indent % 2 == 0 and indent // 2 <= len(folders), f"architecture.md: a level skipped: {line!r}"
            del folders[indent // 2:]
            name, _, role = line.strip().partition(" ")
            listed["/".join([*folders, name.rstrip("/")])] = role.strip()
            if name.endswith("/"):
                folders.append(name.rstrip("/"))
    return listed


def test_architecture_names_every_module_with_its_role() -> None:
    listed = _architecture_tree()
    modules = _package_modules()
    missing = sorted(modules - set(listed))
    gone = sorted(path for path in listed if not (ROOT / path).exists())
    no_role = sorted(path for path, role in listed.items() if not role and path not in DOCUMENTED)
    assert not missing, "modules docs/architecture.md does not name:\n" + "\n".join(missing)
    assert not gone, "docs/architecture.md names what is not there:\n" + "\n".join(gone)
    assert not no_role, "no role given in docs/architecture.md:\n" + "\n".join(no_role)
    assert len(modules) > 200  # the tree was read


def test_the_architecture_check_reads_nested_folders() -> None:
    listed = _architecture_tree()
    assert "belayer_engine/backends/sglang/kv_hooks/belayer_kv_adopt.py" in listed
    assert "belayer/examples/swe_rl/run.py" in listed and "benchmarks/main_job.py" in listed


FIGURE = re.compile(r"\b\d[\d,]*(?:\.\d+)?\s?(?:ms|s|MiB|GiB|GB|tokens/s)\b")
MEASURED = re.compile(r"(?i)\bmeasured\b|\bp50\b|\bp90\b|\bmedian\b")
RESULT_FILE = re.compile(r"benchmarks/results/([\w.{},-]+)")
MACHINE = re.compile(r"(?i)\b(?:\d+-core|\d+ CPUs?|CPU|VM|H100|H200|GPU|machine)\b")
SGLANG_VERSION = re.compile(r"SGLang \d+\.\d+\.\d+")
# sections that say "measured" of what the code measures, and quote no benchmark figure
NO_FIGURES = {("docs/env.md", "## Checkpoints in the generation bubble (`belayer_env/env/policy.py`)")}


def _sections() -> list[tuple[str, str, str]]:
    """(page, heading, text) of every section of every page, code blocks left out."""
    out = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
        for section in re.split(r"^(?=#{1,4} )", text, flags=re.MULTILINE):
            out.append((page.relative_to(ROOT).as_posix(), section.partition("\n")[0], section))
    return out


def test_each_measured_figure_names_its_machine_and_result_file() -> None:
    """A section that quotes a measurement names the result file it comes from (the paths
    test checks that it exists) and the machine; where that file is an SGLang run, the
    SGLang version too (the H200 ran 0.5.17, set-up installs 0.5.23)."""
    bad = []
    for page, heading, text in _sections():
        if (page, heading) in NO_FIGURES or not (MEASURED.search(text) and FIGURE.search(text)):
            continue
        files = RESULT_FILE.findall(text)
        if not files:
            bad.append(f"{page} {heading!r}: no benchmarks/results/ file")
        if not MACHINE.search(text):
            bad.append(f"{page} {heading!r}: no machine")
        if any("sglang" in name for name in files) and not SGLANG_VERSION.search(text):
            bad.append(f"{page} {heading!r}: an SGLang result without its SGLang version")
    assert not bad, "\n".join(bad)


def test_the_figure_check_sees_figures() -> None:
    quoted = [(page, heading) for page, heading, text in _sections() if MEASURED.search(text) and FIGURE.search(text)]
    assert len(quoted) >= 10 and ("README.md", "# Belayer") in quoted, quoted


RUN_PAGES = ["README.md", "docs/sandbox.md", "docs/capture.md", "docs/restore.md", "docs/fork.md", "docs/env.md"]


def _free_names(source: str) -> set[str]:
    """Names a snippet reads but never binds (not builtins): left for the reader to supply."""
    top = symtable.symtable(source, "snippet", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    free: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            name = sym.get_name()
            if (sym.is_referenced() and (sym.is_global() or table is top) and not sym.is_assigned()
                    and not sym.is_imported() and name not in bound and not hasattr(builtins, name)):
                free.add(name)
        for child in table.get_children():
            walk(child)

    walk(top)
    return free


WHOLE = [(p, n, src) for p, n, src in SNIPPETS if p in RUN_PAGES and not _free_names(src)]


def test_the_whole_snippets_are_found() -> None:
    assert len(WHOLE) >= 8, [(p, n) for p, n, _ in WHOLE]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("page", "line", "source"), WHOLE, ids=[f"{p}:{n}" for p, n, _ in WHOLE])
def test_whole_snippet_runs(page: str, line: int, source: str, docker_client, tmp_path: Path) -> None:
    from belayer_core.procfs import OwnerId
    from belayer_env.ops.gc import list_managed
    from belayer_env.restore.prestaging import docker_root
    from belayer_env.store.shared_layer import lowers_root

    with subprocess.Popen([sys.executable, "-c", source], cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT),
                               "BELAYER_CHECKPOINTS": str(tmp_path / "checkpoints")}) as proc:
        out, err = proc.communicate(timeout=280)
    assert proc.returncode == 0, f"{page}:{line}\n{out[-2000:]}\n{err[-3000:]}"
    pid = f":{proc.pid}"  # the snippet's process owned what it made: nothing of it may be left running
    left = [c for c in list_managed(docker_client) if c.owner.endswith(pid) and c.status == "running"]
    assert not left, left
    # nor a forks' shared layer copy it made (each closed its forks): RAM, where it was unpacked in memory
    copies = lowers_root(docker_root(docker_client))
    made = [p.name for p in (copies.iterdir() if copies.is_dir() else ())
            if getattr(OwnerId.from_label(p.name.rpartition("~")[2]), "pid", None) == proc.pid]
    assert not made, made
