"""OpenAI-compatible router with token-level continuation across worker failures."""

from belayer_engine.common.routing import Endpoint, RoutingTable

from .app import Router
from .config import RouterConfig
from .recovery import Continuation, Generation

__all__ = ["Continuation", "Endpoint", "Generation", "Router", "RouterConfig", "RoutingTable"]
