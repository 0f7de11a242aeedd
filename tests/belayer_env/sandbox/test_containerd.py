"""Where the local dockerd's containerd is, read from dockerd's flags and config file
(``sandbox/containerd.py``); finding and removing what it keeps: test_ctrd_leftovers.py."""

from __future__ import annotations

import os

from belayer_env.sandbox import containerd
from belayer_env.sandbox.containerd import Daemon


def test_dockerd_settings_name_its_containerd():
    sockets, d = containerd._settings(["dockerd"], managed=True)
    assert sockets == {os.path.realpath("/var/run/docker.sock")}
    assert d == Daemon("/var/run/docker/containerd/containerd.sock", "moby", "/var/run/docker")
    _, d = containerd._settings(["dockerd", "-H", "fd://"], managed=False)
    assert d.address == containerd.SYSTEM_CONTAINERD
    sockets, d = containerd._settings(
        ["dockerd", "--containerd=/run/c.sock", "--containerd-namespace", "ns", "--exec-root=/run/d2",
         "-H", "unix:///run/d2.sock", "--config-file", "/nonexistent.json"], managed=True)
    assert sockets == {"/run/d2.sock"} and d == Daemon("/run/c.sock", "ns", "/run/d2")
