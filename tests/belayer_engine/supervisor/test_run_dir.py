"""The engine's run dir holds its control and weight sockets: private, or refused."""

from pathlib import Path

import pytest

from belayer_core.errors import UsageError
from belayer_engine.supervisor.supervisor import private_run_dir


def test_new_run_dir_is_created_private(tmp_path):
    path = private_run_dir(tmp_path / "a" / "run")
    assert path.stat().st_mode & 0o777 == 0o700


def test_run_dir_writable_by_others_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UsageError, match="writable by group or others"):
        private_run_dir(shared)


def test_gc_takes_only_own_run_dirs_whose_engine_is_gone(tmp_path, monkeypatch):
    """A /tmp anyone writes to: gc removes this user's run dirs of dead engines and nothing
    a link, another user's dir or a missing or linked owner file points it at."""
    import os
    import subprocess
    import sys

    from belayer_core.procfs import OwnerId
    from belayer_engine.supervisor import run_dir as run_dirs

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    live = run_dirs.temp_run_dir()
    assert (Path(live.name) / "owner").read_text() == OwnerId.current().to_label()
    assert Path(live.name).parent == tmp_path and Path(live.name).stat().st_mode & 0o777 == 0o700
    gone = subprocess.run([sys.executable, "-c", "from belayer_engine.supervisor.run_dir import temp_run_dir as t;"
                           "d = t(); print(d.name); import os; os._exit(0)"],  # no clean-up of its own
                          capture_output=True, text=True, check=True, env={**os.environ}).stdout.strip()
    (Path(gone) / "w0-worker-1.log").write_text("log")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "owner").write_text("1-1")  # a dead owner, but not a run dir: reached only through links
    (tmp_path / "belayer-engine-link").symlink_to(victim)
    linked_owner = tmp_path / "belayer-engine-linked-owner"
    linked_owner.mkdir()
    (linked_owner / "owner").symlink_to(victim / "owner")
    no_owner = tmp_path / "belayer-engine-no-owner"
    no_owner.mkdir()
    others = tmp_path / "belayer-engine-others"
    others.mkdir()
    (others / "owner").write_text("1-1")
    os.chown(others, 65534, 65534)

    assert run_dirs.orphaned() == [Path(gone)]
    assert run_dirs.reap_orphans() == [gone] and not Path(gone).exists()
    assert Path(live.name).exists() and victim.exists() and (victim / "owner").exists()
    assert linked_owner.exists() and no_owner.exists() and others.exists()
    live.cleanup()
