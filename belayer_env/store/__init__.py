"""Where checkpoints live: the manifest, the 0700 store, the layer tar, capture scratch space,
forks' shared read-only layer copies, and replicas at an fsspec URL."""
