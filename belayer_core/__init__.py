"""The shared base of both halves: the failure taxonomy (``errors``), the ``/proc`` reader and
owner-liveness rule (``procfs``), config-derived flags (``config_flags``). It imports neither
``belayer_env`` nor ``belayer_engine``; the ``belayer`` command line sits above all three."""

__version__ = "0.1.0"  # the distribution's (pyproject.toml); ``belayer.__version__`` too
