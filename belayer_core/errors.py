"""The failure taxonomy: one hierarchy, so recovery decisions key on types, not text.

Agent outcomes (nonzero exit codes, command timeouts chosen by the task) are *data* and are
returned as observations. Everything below is an *exception*: infrastructure failures
(``InfraError``) are recovered from and never shown to the agent as an observation; bad
input (``UsageError``) is reported with a message that names the problem.
"""

from __future__ import annotations


class BelayerError(Exception):
    """Root of every error Belayer raises on purpose."""


# --------------------------------------------------------------------------- usage


class UsageError(BelayerError, ValueError):
    """Bad input from the caller: a clear message, nothing lost, nothing to recover."""


class ConfigError(UsageError):
    """A configuration value is invalid or inconsistent."""


class InvalidAction(UsageError):
    """An action (command) passed to a sandbox or env is not acceptable (wrong type, empty...)."""


class CheckpointNotFound(UsageError):
    """A checkpoint named by the caller does not exist in the store."""


class StaleWeightVersion(UsageError):
    """A weight update asked for a version that is not newer than the one already served."""


# --------------------------------------------------------------------------- infrastructure


class InfraError(BelayerError):
    """An infrastructure failure: the effects of the interrupted operation are unknown.

    Recovery restores a consistent prefix; the operation is never retried on old state.
    """


class DaemonUnavailable(InfraError):
    """The container engine (Docker daemon) cannot be reached or answered with a server error."""


class SandboxLost(InfraError):
    """The sandbox container died, was removed, was OOM-killed, or its exec transport broke."""


class NodeLost(SandboxLost):
    """The machine (Ray node) that ran a sandbox is gone, and with it the sandbox and its local state."""


class CheckpointFailed(InfraError):
    """A checkpoint could not be completed; nothing was published and older ones are intact."""


class RestoreFailed(InfraError):
    """A checkpoint could not be restored (corrupt, incomplete, or the runtime refused it).

    ``checkpoint`` names the checkpoint so the caller can fall back to an older one.
    """

    def __init__(self, message: str, checkpoint: str | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint


class WorkerLost(InfraError):
    """An inference worker died, stalled, or broke its stream mid-response."""


class ArenaLost(InfraError):
    """The arena server that owns weights and KV memory is gone or unhealthy."""


class DeviceUnhealthy(InfraError):
    """A device failed again right after handover and was excluded from service."""


# --------------------------------------------------------------------------- one request


class RequestFailed(BelayerError):
    """One request failed while its worker stayed healthy (an error inside that request,
    or a request that took down a replacement worker too): that request ends with this
    error; it is not replayed, and no worker or device is blamed for it."""


class Overloaded(BelayerError):
    """The engine already holds as much waiting work as it queues: this request is refused
    whole before any of it runs (HTTP 429); nothing failed, try again later."""


__all__ = [
    "ArenaLost",
    "BelayerError",
    "CheckpointFailed",
    "CheckpointNotFound",
    "ConfigError",
    "DaemonUnavailable",
    "DeviceUnhealthy",
    "InfraError",
    "InvalidAction",
    "NodeLost",
    "Overloaded",
    "RequestFailed",
    "RestoreFailed",
    "SandboxLost",
    "StaleWeightVersion",
    "UsageError",
    "WorkerLost",
]
