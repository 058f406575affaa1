"""Hosts for the multi-host tests: network namespaces on a bridge (`benchmarks/hostnet/`), removed at the
end of the module that made them, also when a test fails; a run killed before its teardown is reaped
by the next run (its state file names a dead pid). Needs root (CI and the development box run as root)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.hostnet.netns import HostNet, leftovers  # noqa: E402
from benchmarks.hostnet.ray_hosts import RayHosts  # noqa: E402


def pytest_collection_modifyitems(items):
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="network namespaces need root")
        for item in items:
            if "multihost" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="module")
def host_net():
    """Three hosts: 0 runs the Ray head (front, coordinator), 1 advertises `prefill`, 2 `decode`."""
    net = HostNet(3).up()
    try:
        yield net
    finally:
        net.down()
        left = leftovers(net.run_id)
        assert not left, f"teardown left {left}"


# Ray's node-death detection, shortened so that a host cut past it fits the module's budget: the head
# checks each node every second and declares it dead after 10 failed checks in a row (~10-20 s).
# Ray's defaults (every 3 s, a 10 s timeout, 5 failures) let a 45 s cut pass unnoticed and declared
# the node dead within a 120 s one (benchmarks/results/hosts_cut_long.txt, which keeps the defaults).
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                   "RAY_health_check_failure_threshold": "10"}


@pytest.fixture(scope="module")
def ray_hosts(host_net):
    rh = RayHosts(host_net, roles={1: {"prefill": 1}, 2: {"decode": 1}}, num_cpus={0: 2, 1: 1, 2: 1},
                  extra_env={"RAYPD_API_KEYS": "sk-raypd-hosts-test", **FAST_NODE_DEATH})
    yield rh.start()
