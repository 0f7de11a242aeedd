"""Operations: readiness checks (``belayer doctor``) and reaping orphans (``belayer gc``)."""
