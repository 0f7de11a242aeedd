"""Toy SWE tasks: tiny Python repos with one planted bug and a failing unittest.

Each task is a module with one wrong line (``return a - b`` in ``add``) and a test file
that fails until it is fixed. The sandbox's base image has python3 but no pytest, so tests
are plain ``unittest``. Prompts and files are short on purpose: the embedded policy is a
byte-level model, so every byte is a token.
"""

from __future__ import annotations

import base64
import random
import shlex

from pydantic import BaseModel

REPO_DIR = "/repo"
SUBMIT = "submit"
"""The action that ends an episode (installed by ``setup_commands``; prints the env's submit marker)."""
SUBMIT_PATH = f"/usr/local/bin/{SUBMIT}"

# function name, arguments, correct expression, buggy expression, the shortest edit that fixes
# it (old, new), test cases (args, result). ``old`` avoids sed regex specials (. * [ ^ $ \\ /)
# and occurs once in the module, so ``sed -i 's/OLD/NEW/'`` is a literal one-spot fix.
FUNCTIONS: list[tuple[str, str, str, str, tuple[str, str], list[tuple[tuple, object]]]] = [
    ("add", "a, b", "a + b", "a - b", ("a - b", "a + b"), [((2, 3), 5), ((0, 4), 4)]),
    ("sub", "a, b", "a - b", "a + b", ("a + b", "a - b"), [((5, 3), 2), ((1, 4), -3)]),
    ("mul", "a, b", "a * b", "a + b", ("a + b", "a * b"), [((2, 3), 6), ((4, 5), 20)]),
    ("inc", "n", "n + 1", "n - 1", ("n - 1", "n + 1"), [((1,), 2), ((9,), 10)]),
    ("dec", "n", "n - 1", "n + 1", ("n + 1", "n - 1"), [((1,), 0), ((9,), 8)]),
    ("square", "x", "x * x", "x + x", ("x + x", "x * x"), [((3,), 9), ((5,), 25)]),
    ("is_even", "n", "n % 2 == 0", "n % 2 == 1", ("== 1", "== 0"), [((4,), True), ((7,), False)]),
    ("is_odd", "n", "n % 2 == 1", "n % 2 == 0", ("== 0", "== 1"), [((3,), True), ((8,), False)]),
    ("is_pos", "x", "x > 0", "x < 0", ("x < 0", "x > 0"), [((3,), True), ((-2,), False)]),
    ("is_neg", "x", "x < 0", "x > 0", ("x > 0", "x < 0"), [((-3,), True), ((2,), False)]),
    ("maxi", "a, b", "a if a > b else b", "a if a < b else b", ("a < b", "a > b"), [((2, 7), 7), ((9, 1), 9)]),
    ("mini", "a, b", "a if a < b else b", "a if a > b else b", ("a > b", "a < b"), [((2, 7), 2), ((9, 1), 1)]),
]
MODULES = ["calc", "util", "ops", "mathx"]


class Task(BaseModel):
    """One repo: ``files`` go to ``/repo``; ``test_command`` exits 0 once the bug is fixed."""

    id: str
    module: str
    function: str
    prompt: str
    files: dict[str, str]
    old: str
    new: str

    @property
    def source_file(self) -> str:
        return f"{self.module}.py"

    @property
    def test_command(self) -> str:
        return f"python3 test_{self.module}.py"

    def setup_commands(self) -> list[str]:
        """Shell commands that write the repo inside a fresh sandbox (no network needed), plus
        a ``submit`` command (as in SWE-agent) that prints the env's submit marker: a short
        action matters when every byte is a token."""
        from belayer_env.env.recoverable import (
            SUBMIT_MARKER,  # lazily: the task set itself needs no Docker
        )

        cmds = [f"mkdir -p {REPO_DIR}", f"printf '#!/bin/sh\\necho {SUBMIT_MARKER}\\n' > {SUBMIT_PATH}",
                f"chmod +x {SUBMIT_PATH}"]
        for name, text in sorted(self.files.items()):
            blob = base64.b64encode(text.encode()).decode()
            cmds.append(f"echo {blob} | base64 -d > {shlex.quote(f'{REPO_DIR}/{name}')}")
        return [" && ".join(cmds)]

    def fix_command(self) -> str:
        """The one-line fix an expert would type."""
        return f"sed -i 's/{self.old}/{self.new}/' {self.source_file}"

    def reset_options(self, image: str | None = None) -> dict:
        options: dict = {"task": self.prompt, "setup": self.setup_commands()}
        if image:
            options["image"] = image
        return options


def _module_text(func: str, args: str, body: str) -> str:
    return f"def {func}({args}):\n    return {body}\n"


def _test_text(module: str, func: str, cases: list[tuple[tuple, object]]) -> str:
    checks = "\n".join(f"        self.assertEqual({func}{args!r}, {want!r})"
                       .replace(",)", ")") for args, want in cases)
    # no .pyc: a same-size edit within the same second would otherwise run stale bytecode
    return (f"import sys\nimport unittest\n\nsys.dont_write_bytecode = True\n"
            f"from {module} import {func}  # noqa: E402\n\n\n"
            f"class T(unittest.TestCase):\n    def test_{func}(self):\n{checks}\n\n\n"
            "unittest.main()\n")


def make_task(func_index: int, module: str) -> Task:
    func, args, good, bad, (old, new), cases = FUNCTIONS[func_index]
    prompt = f"Fix {func}() in {module}.py."
    return Task(
        id=f"{module}-{func}", module=module, function=func, prompt=prompt,
        files={f"{module}.py": _module_text(func, args, bad),
               f"test_{module}.py": _test_text(module, func, cases)},
        old=old, new=new,
    )


def all_tasks() -> list[Task]:
    """Every generated variant (functions x module names: 48 repos)."""
    return [make_task(i, m) for i in range(len(FUNCTIONS)) for m in MODULES]


def sample_tasks(n: int, seed: int = 0) -> list[Task]:
    """``n`` distinct tasks, reproducibly shuffled."""
    tasks = all_tasks()
    random.Random(seed).shuffle(tasks)
    return tasks[:n]
