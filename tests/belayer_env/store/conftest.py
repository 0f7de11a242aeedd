"""Fixtures of the store's tests."""

from tests.belayer_env.store.as_nobody import public_dir  # noqa: F401
