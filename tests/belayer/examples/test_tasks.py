"""Every generated repo really fails before its fix and passes after, in a real sandbox."""

from __future__ import annotations

from belayer.examples.swe_rl.tasks import REPO_DIR, all_tasks, sample_tasks
from belayer_env import DockerSandbox
from belayer_env.env.recoverable import SUBMIT_MARKER


def test_tasks_fail_before_and_pass_after_fix(docker_client):
    tasks = all_tasks()
    assert len(tasks) >= 36 and len({t.id for t in tasks}) == len(tasks)
    with DockerSandbox(client=docker_client, cwd="/") as sb:
        for task in tasks:  # two execs per task: set up + run the tests, then fix + run them
            setup = " && ".join([f"rm -rf {REPO_DIR}", *task.setup_commands(), f"cd {REPO_DIR}"])
            before = sb.execute(f"{setup} && {task.test_command}")
            assert before["returncode"] == 1 and "FAILED" in before["output"], (task.id, before)
            after = sb.execute(f"{task.fix_command()} && {task.test_command}", cwd=REPO_DIR)
            assert after["returncode"] == 0 and "OK" in after["output"], (task.id, after)
        submitted = sb.execute("submit")
        assert submitted["output"].splitlines()[0] == SUBMIT_MARKER


def test_sample_is_reproducible():
    assert [t.id for t in sample_tasks(8, seed=3)] == [t.id for t in sample_tasks(8, seed=3)]
