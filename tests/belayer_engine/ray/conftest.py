"""A real multi-node Ray cluster on this machine: a head (the driver and the router; no
slots) and three raylets that can each host one engine slot. Nothing is mocked: "a node"
is a real raylet with its own worker processes."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cluster():
    """``(cluster, [node, node, node])``; a node removed by a test is gone for the module."""
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        pytest.fail("these tests need the ray extra: pip install 'belayer[ray]' (scripts/setup.sh installs it)")
    from belayer_engine.ray import SLOT_RESOURCE

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "resources": {SLOT_RESOURCE: 0},
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                           "health_check_initial_delay_ms": 0}})
    try:
        nodes = [c.add_node(num_cpus=1, resources={SLOT_RESOURCE: 1})
                 for _ in range(3)]
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes(timeout=120)
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()
