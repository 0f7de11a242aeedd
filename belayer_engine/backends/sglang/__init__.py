"""SGLang servers as Belayer workers and shadows, on weights the arena side owns.

Torch-free at import: the supervisor and router import this package; only
``weight_server`` imports torch (it runs in the weight owner's process).
"""
