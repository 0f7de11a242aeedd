"""Orphaned sandboxes (owner process SIGKILLed) are found and reaped; live ones are kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from belayer.cli import main as cli_main
from belayer_env.ops.gc import list_managed

CHILD = """
import os, signal, sys
from belayer_env import DockerSandbox
sb = DockerSandbox()
print(sb.container_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # crash without close()
"""


def test_orphans_of_a_killed_process_are_reaped(sandbox, docker_client, capsys):
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
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


WEDGED = """
import os, signal, sys
from belayer_env import DockerSandbox
for disk in ("64m", "64m", None):  # the third without a capped layer, so that a file can pin it
    print(DockerSandbox(name_prefix="belayer-gctest", disk=disk).container_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_gc_thaws_wedged_containers_and_reports_one_it_cannot_remove(docker_client, capsys):
    """Three orphans: one frozen through its cgroup behind Docker's back (a capture killed
    mid-pause), one paused through Docker, one Docker cannot remove (an immutable file in its
    layer; a capped layer is unmounted as a whole, so this one has none). gc removes the first
    two and reports the third with the reason."""
    from belayer_env.sandbox import freezer

    p = subprocess.run([sys.executable, "-c", WEDGED], capture_output=True, text=True, timeout=180,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    frozen, paused, stuck = p.stdout.split()
    control = freezer.control_file(frozen)
    control.write_text("FROZEN" if control.name == "freezer.state" else "1")
    assert freezer.is_frozen(frozen)
    docker_client.api.pause(paused)
    upper = docker_client.api.inspect_container(stuck)["GraphDriver"]["Data"]["UpperDir"]
    pinned = os.path.join(upper, "pinned")
    open(pinned, "w").close()
    subprocess.run(["chattr", "+i", pinned], check=True)
    names = {c.id: c.name for c in list_managed(docker_client)}
    try:
        assert cli_main(["gc", "--json"]) == 1  # something could not be removed
        report = json.loads(capsys.readouterr().out)
        assert names[frozen] in report["removed"] and names[paused] in report["removed"]
        assert names[stuck] in report["failed"] and "not permitted" in report["failed"][names[stuck]]
        left = {c.id for c in list_managed(docker_client)}
        assert frozen not in left and paused not in left and stuck in left
    finally:
        subprocess.run(["chattr", "-i", pinned], check=True)
    assert cli_main(["gc", "--json"]) in (0, 1)
    assert names[stuck] in json.loads(capsys.readouterr().out)["removed"]
    assert stuck not in {c.id for c in list_managed(docker_client)}
