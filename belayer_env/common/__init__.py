"""What every part of the environment half uses and that belongs to none of them: the
phases a checkpoint or restore goes through (``phases``), and background work that never
outlives its caller's failure handling (``background``)."""
