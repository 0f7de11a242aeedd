"""Weight sync: how a trainer's new weights reach every slot at one engine-wide version.

``sync`` (held by the supervisor: versions, pushes to every arena, cold-restart re-apply),
``retained`` (the kept host copy), ``endpoint`` / ``client`` / ``wire`` (a learner in
another process, over a 0600 Unix socket), ``disk`` / ``tensor`` (SGLang's
``update_weights_from_disk`` / ``_from_tensor`` payloads, decoded for the router's routes).
"""
