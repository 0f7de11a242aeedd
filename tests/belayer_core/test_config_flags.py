"""Flags derived from pydantic configs: names, defaults and help come from the model only."""

from __future__ import annotations

import argparse
import enum
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from belayer.cli import main
from belayer_core.config_flags import ConfigFlags
from belayer_core.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rate: float = Field(default=0.5, ge=0, le=1)
    """How often, 0..1 (100% = always)."""
    steps: list[int] = Field(default_factory=lambda: [3])


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    out_dir: str = Field(default="out", description="where results go")
    workers: int = Field(default=1, ge=1)
    shadow: bool = True
    recovery: Literal["token", "chunk"] = "token"
    color: Color = Color.RED
    timeout_s: float | None = None
    name: str | None = None
    path: Path = Path("/tmp")
    args: list[str] = Field(default_factory=list)
    inner: Inner = Field(default_factory=Inner)


def _parser(flags: ConfigFlags) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    flags.add_to(p)
    return p


def _build(argv: list[str], **kwargs) -> Outer:
    flags = ConfigFlags(Outer, **kwargs)
    return flags.build(_parser(flags).parse_args(argv))


def test_no_flags_give_the_models_own_defaults():
    assert _build([]) == Outer()


def test_every_kind_of_field_parses_into_the_model():
    cfg = _build(["--out-dir", "x", "--workers", "3", "--no-shadow", "--recovery", "chunk", "--color", "blue",
                  "--timeout-s", "2.5", "--name", "none", "--path", "/var", "--args=--preset=big", "--args", "a",
                  "--inner-rate", "0.25", "--inner-steps", "1", "5"])
    assert cfg == Outer(out_dir="x", workers=3, shadow=False, recovery="chunk", color=Color.BLUE, timeout_s=2.5,
                        name="none", path=Path("/var"), args=["--preset=big", "a"],
                        inner=Inner(rate=0.25, steps=[1, 5]))


def test_none_word_and_empty_list():
    cfg = _build(["--timeout-s", "3", "--timeout-s", "none", "--inner-steps"])
    assert cfg.timeout_s is None and cfg.inner.steps == []


def test_invalid_values_name_their_flag():
    with pytest.raises(UsageError) as exc:
        _build(["--workers", "0", "--inner-rate", "x", "--inner-steps", "1", "two"])
    text = str(exc.value)
    assert "--workers: Input should be greater than or equal to 1" in text
    assert "--inner-rate: Input should be a valid number" in text and "'x'" in text
    assert "--inner-steps: Input should be a valid integer" in text


def test_unknown_flag_and_bad_choice_exit_2(capsys):
    flags = ConfigFlags(Outer)
    for argv in (["--wokers", "2"], ["--recovery", "block"], ["--color", "green"]):
        with pytest.raises(SystemExit) as exc:
            _parser(flags).parse_args(argv)
        assert exc.value.code == 2
    assert "invalid choice: 'green'" in capsys.readouterr().err


def test_command_defaults_exclusions_and_fixed_values():
    flags = ConfigFlags(Outer, exclude={"name", "inner.steps"}, defaults={"workers": 4})
    p = _parser(flags)
    assert "--name" not in p.format_help() and "--inner-steps" not in p.format_help()
    assert re.search(r"--workers N\s+\(default: 4\)", p.format_help())
    assert flags.build(p.parse_args([]), name="set") == Outer(workers=4, name="set")
    assert flags.build(p.parse_args(["--workers", "2"])).workers == 2
    with pytest.raises(SystemExit):
        p.parse_args(["--name", "x"])


def test_help_shows_description_and_default():
    text = " ".join(_parser(ConfigFlags(Outer)).format_help().split())
    assert "--out-dir TEXT where results go (default: out)" in text
    assert "--shadow, --no-shadow (default: True)" in text
    assert "--inner-rate X How often, 0..1 (100% = always). (default: 0.5)" in text
    assert "--inner-steps [N ...] (default: 3)" in text
    assert "--recovery {token,chunk} (default: token)" in text
    assert "--color {red,blue} (default: red)" in text


def test_prefix_and_programming_errors():
    assert ConfigFlags(Outer, prefix="run").flag("inner.rate") == "--run-inner-rate"
    with pytest.raises(ValueError, match="no field 'nope'"):
        ConfigFlags(Outer, exclude={"nope"})

    class Bad(BaseModel):
        table: dict[str, int] = Field(default_factory=dict)

    with pytest.raises(TypeError, match="field 'table'"):
        ConfigFlags(Bad).add_to(argparse.ArgumentParser())
    ConfigFlags(Bad, exclude={"table"}).add_to(argparse.ArgumentParser())


def _help(argv: list[str]) -> str:
    out = subprocess.run([sys.executable, "-m", "belayer", *argv, "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return " ".join(out.stdout.split())


def _assert_lists(text: str, flags: ConfigFlags, model: type[BaseModel], excluded: set[str]) -> None:
    for name, info in model.model_fields.items():
        if name in excluded or isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            continue
        default = info.default_factory() if info.default_factory else info.default
        flag = flags.flag(name)
        shown = " ".join(map(str, default)) or "(none)" if isinstance(default, list) else str(default)
        if name == "port":
            shown = "8000"  # the server's usual port (the config's 0 = any port suits embedding)
        assert re.search(rf"{re.escape(flag)}\b.*?\(default: {re.escape(shown)}\)", text), (flag, shown)


def test_serve_help_lists_every_config_field_with_its_default():
    from belayer.cli import serve_engine
    from belayer_engine.router import RouterConfig
    from belayer_engine.supervisor.config import SupervisorConfig

    engine = _help(["serve", "engine"])
    _assert_lists(engine, serve_engine._router_flags(("tokenizer",)), RouterConfig, {"tokenizer", "worker_api_key"})
    _assert_lists(engine, serve_engine._supervisor_flags(), SupervisorConfig, {"host", "python"})
    router = _help(["serve", "router"])
    _assert_lists(router, serve_engine._router_flags(), RouterConfig, {"worker_api_key"})  # a secret: no flag


def test_demo_help_lists_every_run_config_field_with_its_default():
    from belayer.cli.demo import FLAGS
    from belayer.examples.swe_rl.config import RunConfig

    text = _help(["demo"])
    _assert_lists(text, FLAGS, RunConfig, set())
    for part in ("agent", "learner", "faults"):
        model = RunConfig.model_fields[part].annotation
        for name in model.model_fields:
            if f"{part}.{name}" != "learner.seed":
                assert FLAGS.flag(f"{part}.{name}") in text


@pytest.mark.parametrize("argv", [
    ["serve", "router", "--worker", "http://127.0.0.1:9", "--chunk-tokens", "0"],
    ["serve", "engine", "--workers", "0"],
    ["demo", "--steps", "0"],
    ["demo", "--tasks-per-step", "9"],  # more than the 8 tasks of the set
])
def test_invalid_config_values_are_usage_errors(argv, capsys):
    assert main(argv) == 2  # before anything starts
    assert "error:" in capsys.readouterr().err
