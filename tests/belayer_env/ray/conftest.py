"""A real multi-node Ray cluster on this machine: a head (the driver; no sandboxes) and two
raylets with a sandbox limit each, all on the one local Docker engine. Nothing is mocked:
"a node" is a real raylet with its own worker processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket

import pytest

from tests.conftest import wait_until

SLOTS_PER_NODE = 4
# a node is dead after 3 failed checks; a hung one (SIGSTOP) fails each check by its timeout
FAST_HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                      "health_check_initial_delay_ms": 0, "health_check_timeout_ms": 2000}


def _need_ray():
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.fail("these tests need the ray extra: pip install 'belayer[ray]' (scripts/setup.sh installs it)")


@pytest.fixture(scope="module")
def ray_cluster():
    """``(cluster, [node_b, node_c])``; a node removed by a test is gone for the module."""
    _need_ray()
    import ray
    from ray.cluster_utils import Cluster

    from belayer_env.ray import SANDBOX_RESOURCE

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "resources": {SANDBOX_RESOURCE: 0},
        "_system_config": FAST_HEALTH_CHECKS})
    try:
        nodes = [cluster.add_node(num_cpus=1, resources={SANDBOX_RESOURCE: SLOTS_PER_NODE}) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes(timeout=120)
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def node_alive(node_id: str) -> bool:
    import ray

    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def lose_node(cluster, node, pids: list[int], docker_client) -> list[str]:
    """What losing a machine does: its raylet is gone, then every process and container of it.

    The raylet goes first and Ray must see the node dead (bounded wait) before its env
    actors die, so their replacements are placed on a live node. Returns the ids of the
    containers killed (found by the belayer owner labels of the lost actors).
    """
    from belayer_env.faults.inject import kill_container
    from belayer_env.sandbox.ownership import OWNER_HOST, OWNER_PID

    cluster.remove_node(node, allow_graceful=False)
    wait_until(lambda: not node_alive(node.node_id), 30, f"Ray to see node {node.node_id[:12]} dead")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    killed = []
    for pid in pids:
        labels = [f"{OWNER_PID}={pid}", f"{OWNER_HOST}={socket.gethostname()}"]
        for c in docker_client.api.containers(filters={"label": labels}):
            kill_container(docker_client, c["Id"])
            killed.append(c["Id"])
    return killed
