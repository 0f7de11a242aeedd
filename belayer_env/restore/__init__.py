"""Restore: ``full_restore`` into a fresh container, pre-staging ahead of a failure, the
standby sandbox (restored ahead, kept frozen), the spare container, containerd's copies."""
