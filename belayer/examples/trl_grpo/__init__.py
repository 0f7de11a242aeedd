"""A real trainer end to end: TRL's GRPO over Belayer's env and engine, with faults.

``/opt/belayer/trl-venv/bin/python -m belayer.examples.trl_grpo`` (TRL 1.16 lives in that
venv, made by ``scripts/setup_trl.sh``, part of ``scripts/setup.sh``; the venv sees the
project's packages). TRL's ``GRPOTrainer`` trains the embedded HF-layout model on CPU;
its ``rollout_func`` runs every sample as a multi-turn episode in a
``RecoverableSandboxEnv`` against a ``RecoverableEngine``; the weights go to the engine
after every optimizer step; containers are SIGKILLed while the model generates and the
serving worker is SIGKILLed mid-generation. ``--mode environment_factory`` runs the same
through TRL's own tool-calling loop (``environment.py``, ``trainer.py``). ``docs/training.md``
has the figures.
"""
