"""``belayer.errors``: the failure taxonomy, kept importable under its first name. It lives in
:mod:`belayer_core.errors`, the shared base both halves import."""

from belayer_core.errors import *  # noqa: F403
from belayer_core.errors import __all__  # noqa: F401
