"""Belayer: fault tolerance for LLM agentic RL training.

Two halves usable apart: :mod:`belayer_env` (recoverable Docker sandboxes) and
:mod:`belayer_engine` (recoverable inference engine). This package holds only what both
share — the failure taxonomy (``errors``), the ``/proc`` reader and owner-liveness rule
(``procfs``) — and the ``belayer`` command line.
"""

__version__ = "0.1.0"
