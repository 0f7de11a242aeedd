"""Orphaned sandboxes (owner process SIGKILLed) are found and reaped; live ones are kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from belayer.cli import main as cli_main
from belayer_env.gc import list_managed

CHILD = """
import os, signal, sys
from belayer_env import DockerSandbox
sb = DockerSandbox()
print(sb.container_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # crash without close()
"""


def test_orphans_of_a_killed_process_are_reaped(sandbox, docker_client, capsys):
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert p.returncode == -signal.SIGKILL, p.stderr
    orphan_id = p.stdout.strip()
    by_id = {c.id: c for c in list_managed(docker_client)}
    assert by_id[orphan_id].orphaned
    assert not by_id[sandbox.container_id].orphaned  # ours: its owner (this process) lives

    assert cli_main(["gc", "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["removed"] == [] and by_id[orphan_id].name in dry["targets"]
    assert docker_client.api.inspect_container(orphan_id)

    assert cli_main(["gc", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert by_id[orphan_id].name in done["removed"]
    remaining = {c.id for c in list_managed(docker_client)}
    assert orphan_id not in remaining and sandbox.container_id in remaining
    assert sandbox.execute("echo kept")["output"] == "kept\n"
