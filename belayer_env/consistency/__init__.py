"""The consistency harness: real fail-stops at random points must never break prefix consistency."""

from belayer_env.consistency.harness import ConsistencyReport, TrialResult, run_consistency

__all__ = ["ConsistencyReport", "TrialResult", "run_consistency"]
