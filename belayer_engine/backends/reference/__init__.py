"""The reference backend: a compact PyTorch worker speaking SGLang's native protocol.

``worker`` (HTTP, ``python -m belayer_engine.backends.reference.worker``) over ``state``
(arena attached, model and scheduler built), ``scheduler`` (continuous batching over the
paged KV arena), ``model`` / ``ops`` / ``graphs`` (the forward pass), ``sampling``;
``dense`` is a cache-free decoder the tests compare against; ``launcher`` is the
supervisor's side (how to start, activate and probe it).
"""
