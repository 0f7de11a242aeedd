"""SWE agent RL with injected faults: toy repos, an OpenAI-client agent, GRPO, learner checkpoints.

``python3 -m belayer demo`` runs a short version; ``belayer.examples.swe_rl.run`` is the orchestrator.
"""
