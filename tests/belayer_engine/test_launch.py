"""``RecoverableEngine.launch``: one context manager, real processes, nothing left behind."""

from __future__ import annotations

import openai
import pytest

from belayer_engine.engine import RecoverableEngine
from tests.conftest import process_alive

pytestmark = pytest.mark.timeout(240)


def test_launch_defaults_serve_openai_and_clean_up():
    with RecoverableEngine.launch() as engine:
        assert engine.base_url.startswith("http://127.0.0.1:") and engine.base_url.endswith("/v1")
        engine.wait_ready(timeout=120)
        slot = engine.status()["slots"]["w0"]
        pids = [slot["worker_pid"], slot["shadow_pid"], slot["arena_pid"]]
        assert all(pids) and all(process_alive(p) for p in pids)
        client = openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="belayer-default", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
        assert out.usage.completion_tokens >= 1
        from belayer_core.errors import UsageError
        from belayer_engine.arena.client import ArenaClient

        version = ArenaClient(engine.arena_socket()).describe()["version"]
        assert out.model_extra["belayer"]["weight_version"] == version
        with pytest.raises(UsageError, match="no slot 3"):
            engine.arena_socket(3)
    assert not any(process_alive(p) for p in pids), "every child process must be gone after the context exits"


def test_bad_model_fails_fast_with_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="arena"), RecoverableEngine.launch(model=str(tmp_path / "missing"), start_timeout_s=60):
        pass
