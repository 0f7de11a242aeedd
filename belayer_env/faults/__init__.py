"""Real fail-stop faults against a live env's sandbox (``inject``: kill, OOM, killed processes,
a broken exec transport, failed captures and restores) and the host-side memory hog behind
the OOM fault (``oom_hog``, run as a script)."""

from belayer_env.faults.inject import (
    ACTION_FAULTS,
    ActionFault,
    FaultInjector,
    FaultKind,
    How,
    InjectedFault,
    TransportBreaker,
    kill_container,
    kill_processes,
    oom_container,
)

__all__ = ["ACTION_FAULTS", "ActionFault", "FaultInjector", "FaultKind", "How", "InjectedFault",
           "TransportBreaker", "kill_container", "kill_processes", "oom_container"]
