"""The command line: every subcommand has --help; doctor reports real machine state."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from belayer.cli import SUBCOMMANDS, build_parser, main


def _subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return list(action.choices)


def test_all_subcommands_registered():
    assert set(_subcommands()) == set(SUBCOMMANDS)


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert "usage: belayer" in capsys.readouterr().out


def test_console_script_help_and_version():
    out = subprocess.run([sys.executable, "-m", "belayer", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "doctor" in out.stdout
    ver = subprocess.run([sys.executable, "-m", "belayer", "--version"], capture_output=True, text=True, timeout=60)
    assert ver.stdout.startswith("belayer ")


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2


def test_doctor_json_all_required_green(capsys):
    rc = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    failed = [c for c in report["checks"] if c["required"] and not c["ok"]]
    assert rc == 0 and report["ok"], failed
    names = {c["name"] for c in report["checks"]}
    assert {"docker engine", "docker experimental", "criu >= 4.2", "criu check", "base image",
            "kernel checkpoint/restore", "kernel overlayfs", "free disk"} <= names
    assert all(c["fix"] for c in report["checks"] if c["required"])
    # what scripts/setup.sh sets up for speed (optional checks; set up on every machine that ran it)
    speed = {c["name"]: c for c in report["checks"]
             if c["name"] in ("criu loopback hook", "criu kernel-probe cache", "conntrack table", "criu tmpfs tar")}
    assert len(speed) == 4 and all(c["ok"] for c in speed.values()), speed


def test_doctor_says_how_to_fix_an_unreachable_daemon(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")
    rc = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    engine = next(c for c in report["checks"] if c["name"] == "docker engine")
    assert rc == 1 and not engine["ok"] and "setup.sh" in engine["fix"]


def _belayer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", "import sys; from belayer.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_checkpoint_cli_errors_are_one_line_and_create_nothing(tmp_path):
    p = _belayer("checkpoints", "ls", "--store", "/proc/nonexistent")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "no checkpoint store at /proc/nonexistent" in p.stderr, p.stderr

    typo = tmp_path / "chekpoints"
    for args in (["ls"], ["rm", "--incomplete"], ["rm", "--sandbox", "sb"], ["rm", "sb.000001.00000000"]):
        p = _belayer("checkpoints", *args, "--store", str(typo))
        assert p.returncode == 2 and p.stderr.count("\n") == 1, (args, p.stderr)
    assert not typo.exists()  # nothing was created by a mistyped store

    home = tmp_path / "home"  # the default store before anything was checkpointed: listed as empty
    p = _belayer("checkpoints", "ls", env={"BELAYER_HOME": str(home), "BELAYER_CHECKPOINTS": ""})
    assert p.returncode == 0 and "0 checkpoints" in p.stdout and not home.exists()

    store = tmp_path / "store"
    store.mkdir()
    p = _belayer("checkpoints", "rm", "--store", str(store), "--sandbox", "nonexistent")
    assert p.returncode == 2 and "no checkpoints of sandbox 'nonexistent'" in p.stderr
    p = _belayer("checkpoints", "ls", "--store", str(store), "--sandbox", "../etc")
    assert p.returncode == 2 and "invalid sandbox name" in p.stderr
    assert sorted(x.name for x in store.iterdir()) == []  # read-only commands created nothing


def test_doctor_says_what_the_capture_scratch_is(monkeypatch, tmp_path):
    from belayer_env.ops import doctor
    from belayer_env.store import in_memory, scratch, store

    monkeypatch.setattr(store, "DEFAULT_SCRATCH", tmp_path)  # its belayer-scratch: not mounted
    (tmp_path / "belayer-scratch" / "ck~1-2").mkdir(parents=True)
    check = doctor.check_scratch()
    assert not check.ok and not check.required and check.fix
    if in_memory.huge_supported() and os.geteuid() == 0:
        assert "holds captures' scratch" in check.detail, check.detail
    store.CheckpointStore(tmp_path / "store")  # a store opened now: the root is in use, so not mounted over
    assert not scratch.is_mounted(tmp_path / "belayer-scratch")
    assert (tmp_path / "belayer-scratch" / "ck~1-2").is_dir()
