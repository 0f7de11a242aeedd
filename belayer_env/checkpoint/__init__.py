"""Full checkpoints of a sandbox (overlay layer + CRIU runtime) and their store.

``full_checkpoint`` / ``start_checkpoint`` capture, ``prestage`` unpacks the newest one on
Docker's disk ahead of time, ``full_restore`` restores into a fresh container,
``CheckpointStore`` keeps them, ``fence`` kills every container of a sandbox name. See
docs/checkpoint.md for the mechanism.
"""

from belayer_env.checkpoint.capture import full_checkpoint
from belayer_env.checkpoint.manifest import Checkpoint
from belayer_env.checkpoint.pending import PendingCheckpoint, start_checkpoint
from belayer_env.checkpoint.prestaging import prestage
from belayer_env.checkpoint.restore import full_restore
from belayer_env.checkpoint.store import CheckpointStore
from belayer_env.fence import fence
from belayer_env.phases import Phase

__all__ = ["Checkpoint", "CheckpointStore", "PendingCheckpoint", "Phase", "fence", "full_checkpoint",
           "full_restore", "prestage", "start_checkpoint"]
