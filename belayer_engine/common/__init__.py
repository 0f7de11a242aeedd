"""What every part of the engine uses and that belongs to none of them: the routing table
(router and supervisor share it), owner liveness and the worker secret (every child
process), local HTTP helpers (JSON bodies, server-sent events, probes, ports)."""
