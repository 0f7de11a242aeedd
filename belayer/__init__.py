"""Belayer: fault tolerance for LLM agentic RL training.

Two halves usable apart: :mod:`belayer_env` (recoverable Docker sandboxes) and
:mod:`belayer_engine` (recoverable inference engine), over the base both share,
:mod:`belayer_core` (the failure taxonomy, the ``/proc`` reader, config-derived flags).
This package sits above all three: the ``belayer`` command line (:mod:`belayer.cli`),
``belayer.errors`` (the taxonomy under its first name), the Gymnasium wrappers and trainer
adapters (:mod:`belayer.wrappers`) and the runnable examples (:mod:`belayer.examples`).
"""

from __future__ import annotations

from belayer_core import __version__  # noqa: F401
