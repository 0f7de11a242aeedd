"""The taxonomy's shape is a contract: recovery code keys on these types."""

from belayer_core import errors


def test_hierarchy():
    for cls in (errors.SandboxLost, errors.DaemonUnavailable, errors.CheckpointFailed,
                errors.RestoreFailed, errors.WorkerLost, errors.ArenaLost):
        assert issubclass(cls, errors.InfraError) and issubclass(cls, errors.BelayerError)
    for cls in (errors.ConfigError, errors.InvalidAction, errors.CheckpointNotFound):
        assert issubclass(cls, errors.UsageError) and not issubclass(cls, errors.InfraError)
    assert not issubclass(errors.UsageError, errors.InfraError)


def test_restore_failed_names_the_checkpoint():
    e = errors.RestoreFailed("checksum mismatch", checkpoint="sb-1/step-3")
    assert e.checkpoint == "sb-1/step-3" and "checksum" in str(e)
