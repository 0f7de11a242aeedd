"""The supervisor: starts each slot's arena, worker and shadow and runs every engine recovery."""

from belayer_engine.supervisor.config import SupervisorConfig
from belayer_engine.supervisor.supervisor import Supervisor

__all__ = ["Supervisor", "SupervisorConfig"]
