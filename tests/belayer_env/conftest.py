"""Fixtures of belayer_env tests (each area keeps its own module)."""

from tests.belayer_env.conftest_checkpoint import ck_store, criu_hold, make_sandbox  # noqa: F401
from tests.belayer_env.conftest_env import make_env  # noqa: F401, E402  (env tests, issue 4)
