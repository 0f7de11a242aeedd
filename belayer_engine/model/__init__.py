"""What the model is, shared by the arena, the backends and the router: its shape
(``config``), weight names and files (``weights``), tokenizer and chat template.
Torch is only needed for ``weights``' tensor functions."""
