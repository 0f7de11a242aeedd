"""Fixtures of the wrapper tests: real envs (real containers), closed and checked at teardown."""

from __future__ import annotations

from tests.belayer_env.conftest_env import make_env  # noqa: F401
