"""The engine's run dir holds its control and weight sockets: private, or refused."""

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
