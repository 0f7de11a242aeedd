"""Runnable examples built on both halves of Belayer."""
