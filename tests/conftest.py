"""Session-wide settings and fixtures: one local Ray cluster for the whole test session
(2 cores: keep it small), Ray without auth or usage stats, temp dirs under /tmp."""

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        from serving.cluster.ray_profile import apply_ray_profile

        apply_ray_profile()  # the product's default for Ray's own processes (as `raypd up` runs them)
        ray.init(num_cpus=4, include_dashboard=False, namespace="raypd",
                 _temp_dir="/tmp/raypd-ray", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def coordinator(ray_cluster):
    from actors.control.coordinator_actor import start_coordinator

    handle = start_coordinator(max_restarts=5)
    ray_cluster.get(handle.ping.remote())
    yield handle
    ray_cluster.kill(handle)


@pytest.fixture(autouse=True)
def no_false_kills(request):
    """Fails a test that saw the coordinator kill an engine (hung, or past its start-up deadline) unless
    it is marked `injects_faults` (tests/kill_guard.py). Reads nothing in a process without Ray."""
    from kill_guard import false_kills, read_kills

    if request.node.get_closest_marker("injects_faults") is not None:
        yield
        return
    before = read_kills()
    yield
    problem = false_kills(before, read_kills(), injects_faults=False)
    if problem is not None:
        pytest.fail(problem)
