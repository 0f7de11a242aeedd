"""The arena: one process per device that owns the weights (and the reference backend's KV
memory) so workers can die without taking the memory with them.

``server`` is the process (``python -m belayer_engine.arena``), ``versions`` its weight-version
updates, ``memory`` its shared regions, ``protocol`` the control socket's wire format,
``client`` what workers, supervisors and trainers use to talk to it, ``shm_files`` the
torch-free naming and reaping of its files.
"""
