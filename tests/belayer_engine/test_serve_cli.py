"""``belayer serve arena|worker``: parsers build without torch; flags reach the configs."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from belayer.cli import serve


def _parse(argv):
    p = argparse.ArgumentParser()
    serve.add_parser(p.add_subparsers())
    return p.parse_args(argv)


def test_serve_parsers_and_targets():
    a = _parse(["serve", "arena", "--socket", "/tmp/x.sock", "--num-blocks", "9"])
    assert a.func is serve.run and a.serve_runner == "belayer_engine.backends.sglang.arena:run"
    from belayer_engine.backends.reference.config import FLAGS as WORKER_FLAGS
    from belayer_engine.backends.sglang.arena import FLAGS as ARENA_FLAGS

    arena = ARENA_FLAGS.build(a)
    assert arena.socket == "/tmp/x.sock" and arena.num_blocks == 9 and arena.device == "cpu"
    worker = WORKER_FLAGS.build(_parse(["serve", "worker", "--arena-socket", "s", "--shadow", "--port", "0"]))
    assert worker.shadow and worker.port == 0 and worker.host == "127.0.0.1"
    assert {"arena", "worker"} <= set(serve.TARGETS)


def test_building_the_parser_does_not_import_torch():
    code = ("import sys, argparse; from belayer.cli import serve; "
            "p = argparse.ArgumentParser(); serve.add_parser(p.add_subparsers()); "
            "assert 'torch' not in sys.modules and 'aiohttp' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_target_whose_flags_need_a_missing_package_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setitem(serve.TARGETS, "absent", ("belayer_no_such_package.flags:add", "x:run", "needs a package"))
    _parse(["serve", "worker", "--arena-socket", "s"])  # building the parser and other targets: fine
    with pytest.raises(SystemExit) as exc:
        _parse(["serve", "absent"])
    assert exc.value.code == 2
    assert "needs the Python package 'belayer_no_such_package'" in capsys.readouterr().err
