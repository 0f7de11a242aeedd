"""Checkpoint capture: ``full_checkpoint`` (layer + CRIU runtime from one frozen instant),
incremental layer capture, and ``start_checkpoint`` (the same on a background thread)."""
