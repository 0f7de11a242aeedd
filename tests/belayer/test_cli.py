"""The command line: every subcommand has --help; doctor reports real machine state."""

from __future__ import annotations

import json
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


def test_doctor_says_how_to_fix_an_unreachable_daemon(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")
    rc = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    engine = next(c for c in report["checks"] if c["name"] == "docker engine")
    assert rc == 1 and not engine["ok"] and "setup.sh" in engine["fix"]
