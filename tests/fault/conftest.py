"""One local Ray cluster for the whole integration/fault session (2 cores: keep it small)."""

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, namespace="raypd",
                 _temp_dir="/tmp/raypd-ray", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def coordinator(ray_cluster):
    from actors.coordinator import start_coordinator

    handle = start_coordinator(check_interval_s=0.5, ping_timeout_s=5.0)
    ray_cluster.get(handle.ping.remote())
    yield handle
    ray_cluster.kill(handle)

import sys
from pathlib import Path

# the service helpers (free port, in-thread uvicorn, synthetic deployment) live with the integration tests
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
