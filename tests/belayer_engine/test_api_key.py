"""Where the router's API key comes from (issue 12): never only the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from belayer_engine.router import RouterConfig

from .conftest import REPO
from .test_router_hardening import call


def test_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("BELAYER_API_KEY", "from-env")
    assert RouterConfig().api_key == "from-env"
    assert RouterConfig(api_key="given").api_key == "given"  # an explicit key wins


def test_key_from_a_private_file(tmp_path, monkeypatch):
    monkeypatch.delenv("BELAYER_API_KEY", raising=False)
    f = tmp_path / "key"
    f.write_text("from-file\n")
    f.chmod(0o600)
    assert RouterConfig(api_key_file=str(f)).api_key == "from-file"
    f.chmod(0o644)
    with pytest.raises(ValidationError, match="open to other users"):
        RouterConfig(api_key_file=str(f))
    f.chmod(0o600)
    f.write_text("  \n")
    with pytest.raises(ValidationError, match="empty"):
        RouterConfig(api_key_file=str(f))
    with pytest.raises(ValidationError, match="api_key_file"):
        RouterConfig(api_key_file=str(tmp_path / "missing"))


def test_unknown_router_options_are_refused():
    with pytest.raises(ValidationError, match="api_keys"):
        RouterConfig(api_keys="x")


def test_engine_options_are_checked_before_anything_starts():
    from belayer_engine import RecoverableEngine

    with pytest.raises(ValidationError, match="backend"), RecoverableEngine.launch(backend="vllm"):
        pass
    with pytest.raises(ValidationError, match="made_up"), RecoverableEngine.launch(made_up=1):
        pass


@pytest.mark.timeout(120)
def test_serve_router_takes_the_key_from_a_file(tmp_path):
    key = tmp_path / "key"
    key.write_text("file-key")
    key.chmod(0o600)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("BELAYER_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "belayer", "serve", "router", "--worker", "http://127.0.0.1:9",
                          "--port", "0", "--api-key-file", str(key), "--json"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = p.stdout.readline()
        assert line, f"router exited ({p.wait()})"
        base = json.loads(line)["base_url"].removesuffix("/v1")
        assert b"file-key" not in Path(f"/proc/{p.pid}/cmdline").read_bytes()
        assert call(base, "GET", "/v1/models")[0] == 401
        status, out, _ = call(base, "GET", "/v1/models", headers={"Authorization": "Bearer file-key"})
        assert status == 200 and out["data"]
        assert call(base, "GET", "/belayer/workers")[0] == 401
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
