"""Worker backends: what runs behind the router. ``base`` is the one interface the
supervisor uses; ``reference`` is the embedded PyTorch worker (the default)."""
