"""The reference backend: a compact PyTorch worker speaking SGLang's native protocol.

``worker`` (the process, ``python -m belayer_engine.backends.reference.worker``) serves
``routes`` (HTTP; ``sglang_generate`` the ``/generate`` body and answer) over ``state``
(arena attached, model and scheduler built), ``scheduler`` (continuous batching over the
paged KV arena; ``request`` a request and its blocks, ``forward`` one step's logits),
``model`` / ``ops`` / ``graphs`` (the forward pass), ``sampling``; ``dense`` is a
cache-free decoder the tests compare against; ``launcher`` is the supervisor's side (how
to start, activate and probe it).
"""
