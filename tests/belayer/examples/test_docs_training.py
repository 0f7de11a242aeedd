"""docs/training.md's ``rollout_one``, executed as written: real engine processes, a real
sandbox, and a real container kill while the model generates turn 2."""

from __future__ import annotations

import os
import re
from pathlib import Path

import openai
import pytest

from belayer.examples.swe_rl.tasks import sample_tasks
from belayer_env.faults.inject import kill_container
from belayer_env.ops.gc import list_managed

DOC = Path(__file__).resolve().parents[3] / "docs" / "training.md"


def doc_function(name: str) -> dict:
    """The docs' python block that defines ``name``, executed in a fresh namespace."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    source = next((b for b in blocks if f"def {name}(" in b), None)
    assert source is not None, f"docs/training.md defines no {name}()"
    namespace: dict = {}
    exec(compile(source, str(DOC), "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


@pytest.mark.timeout(300)
def test_rollout_one_from_the_docs_survives_a_container_kill(docker_client, monkeypatch):
    from belayer_engine.engine import RecoverableEngine

    calls = []
    real_create = openai.resources.chat.Completions.create

    def create(self, *args, **kwargs):  # the container dies while turn 2 is being generated
        calls.append(len(kwargs["messages"]))
        if len(calls) == 2:
            # this process's live sandbox; an earlier test's container may still be "removing"
            mine = [c for c in list_managed(docker_client)
                    if c.owner.endswith(f":{os.getpid()}") and c.status == "running"]
            assert len(mine) == 1, mine
            kill_container(docker_client, mine[0].id)
        return real_create(self, *args, **{**kwargs, "max_tokens": 64})  # a short test

    monkeypatch.setattr(openai.resources.chat.Completions, "create", create)
    task = sample_tasks(1)[0]
    spec = {"prompt": task.prompt, "setup": task.setup_commands(), "test_cmd": task.test_command}
    rollout_one = doc_function("rollout_one")["rollout_one"]
    with RecoverableEngine.launch() as engine:
        engine.wait_ready(stable=True)
        out = rollout_one(spec, engine.base_url, max_turns=3)

    rollbacks = [e for e in out["infra_events"] if e["kind"] == "rollback"]
    assert out["recovered"] and len(rollbacks) == 1 and rollbacks[0]["at_step"] == 1, out["infra_events"]
    # turn 2 was lost with its container; generation resumed from the restored boundary's
    # context (boundary 1 if the adaptive policy had checkpointed it, else 0)
    j = rollbacks[0]["to_step"]
    assert calls[:3] == [1, 3, 1 + 2 * j], calls
    assert len(out["turns"]) == 3, "one sample per committed step (the lost turn dropped)"
    for j, (messages, token_ids) in enumerate(out["turns"]):
        assert len(messages) == 1 + 2 * j and token_ids, (j, messages)
    assert len(out["weight_versions"]) == 1 and None not in out["weight_versions"]
    assert out["reward"] == 0.0  # the untrained model never submits


SNIPPET = re.compile(r"<!-- from: (\S+) -->\n```\w*\n(.*?)```", re.DOTALL)


def test_every_trainer_snippet_is_the_code_its_test_runs():
    """Each code block of docs/training.md marked ``<!-- from: PATH -->`` appears, line for line
    and in order, in PATH (a test, its driver, or the example a test runs): the docs show the
    code that runs, not a copy that can drift."""
    root = DOC.parents[1]
    snippets = SNIPPET.findall(DOC.read_text())
    sources = {path for path, _ in snippets}
    assert len(snippets) >= 7 and {  # one per trainer at least
        "tests/belayer/wrappers/test_minisweagent_real.py", "tests/belayer/wrappers/episodes.py",
        "tests/belayer/wrappers/test_areal_workflow.py", "tests/belayer/wrappers/test_skyrl.py",
        "tests/belayer/wrappers/verl_driver.py", "belayer/examples/trl_grpo/run.py"} <= sources, sources
    for path, block in snippets:
        lines = [line.rstrip() for line in block.strip("\n").splitlines()]
        source = [line.rstrip() for line in (root / path).read_text().splitlines()]
        starts = [i for i, line in enumerate(source) if line == lines[0]]
        assert any(source[i:i + len(lines)] == lines for i in starts), \
            f"docs/training.md's block from {path} is not in that file:\n{block}"
