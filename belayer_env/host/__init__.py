"""What set-up installs on the host for sandboxes and CRIU: the loopback action hook, the
conntrack table size, the static tar CRIU runs, and how those static helpers are built."""
