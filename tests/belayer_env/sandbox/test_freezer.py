"""A container's cgroup removed between finding it and reading its processes: the kernel
removes only an empty cgroup, so it holds none (a fence that reads it then must count the
container dead, not unknown)."""

from __future__ import annotations

from belayer_env.sandbox import freezer


def test_a_cgroup_removed_after_it_was_found_holds_no_process(tmp_path, monkeypatch):
    removed = tmp_path / "docker" / "0123abcd"  # found, then removed: its files are gone
    monkeypatch.setattr(freezer, "control_file", lambda container_id: removed / "freezer.state")
    assert freezer.procs("0123abcd") == []
    assert freezer.no_process_left("0123abcd") is True


def test_a_cgroup_that_cannot_be_read_for_another_reason_is_unknown(tmp_path, monkeypatch):
    unreadable = tmp_path / "docker" / "0123abcd"
    (unreadable / "cgroup.procs").mkdir(parents=True)  # a read fails with EISDIR: not a removal
    monkeypatch.setattr(freezer, "control_file", lambda container_id: unreadable / "freezer.state")
    assert freezer.procs("0123abcd") is None
    assert freezer.no_process_left("0123abcd") is False


def test_kill_all_counts_a_cgroup_removed_after_its_init_died_as_dead(tmp_path, monkeypatch):
    """The kernel removes the cgroup once its last process is gone: the fence's wait reads that
    as the death it waits for (ENOENT, as ENODEV), not as an unknown state."""
    import shutil
    import subprocess
    import threading

    cgroup = tmp_path / "docker" / "0123abcd"
    cgroup.mkdir(parents=True)
    init = subprocess.Popen(["sleep", "600"])
    (cgroup / "cgroup.procs").write_text(f"{init.pid}\n")
    monkeypatch.setattr(freezer, "control_file", lambda container_id: cgroup / "freezer.state")

    def remove_once_dead() -> None:
        init.wait()
        shutil.rmtree(cgroup)

    remover = threading.Thread(target=remove_once_dead)
    remover.start()
    try:
        assert freezer.kill_all("0123abcd", init.pid, wait_s=60) is True
    finally:
        init.kill()
        remover.join(timeout=60)
    assert init.returncode == -9
    assert freezer.kill_all("0123abcd", init.pid) is True  # removed before the first read: nothing left
