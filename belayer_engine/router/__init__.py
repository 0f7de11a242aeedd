"""OpenAI-compatible router with token-level continuation across worker failures."""

from .app import Router
from .config import RouterConfig
from .recovery import Continuation, Generation
from .table import Endpoint, RoutingTable

__all__ = ["Continuation", "Endpoint", "Generation", "Router", "RouterConfig", "RoutingTable"]
