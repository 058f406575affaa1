"""Ray's own processes sized for serving (serving/cluster/ray_profile.py): the defaults it adds,
the operator's values and the switch back win, and the RayService manifests carry the same
variables on every Ray container."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serving.cluster.ray_profile import (HAPROXY_PORT_ENV, HAPROXY_PORT_RANGE, SERVING_NODE_ENV, RayProfileError,
                                         apply_ray_profile)

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = [ROOT / "k8s" / "base" / "rayservice.yaml", ROOT / "k8s" / "overlays" / "cpu" / "rayservice.yaml"]


def test_the_serving_profile_is_the_default():
    env: dict[str, str] = {}
    added = apply_ray_profile(env)
    assert env == added
    assert {k: env[k] for k in SERVING_NODE_ENV} == SERVING_NODE_ENV
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"


def test_a_local_cluster_gets_free_ports_for_haproxys_other_listeners():
    env: dict[str, str] = {}
    apply_ray_profile(env)
    ports = [int(env[k]) for k in HAPROXY_PORT_ENV]
    assert set(env) == set(SERVING_NODE_ENV) | set(HAPROXY_PORT_ENV)
    low, high = HAPROXY_PORT_RANGE
    # below the kernel's ephemeral ports: no Ray process is handed one of them later
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert (len(set(ports)), all(low <= p <= high for p in ports), high < ephemeral_low) == (2, True, True)


def test_haproxys_ports_the_operator_set_win():
    env = {"RAY_SERVE_HAPROXY_STATS_PORT": "18404"}
    added = apply_ray_profile(env)
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in added and "RAY_SERVE_HAPROXY_METRICS_PORT" in added


def test_serves_own_proxy_when_the_operator_turns_haproxy_off():
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    added = apply_ray_profile(env)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert not set(HAPROXY_PORT_ENV) & set(added)


def test_a_variable_the_operator_set_wins():
    env = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}
    added = apply_ray_profile(env)
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in added


def test_the_switch_back_keeps_rays_defaults():
    env = {"RAYPD_RAY_PROFILE": "ray"}
    assert apply_ray_profile(env) == {}
    assert env == {"RAYPD_RAY_PROFILE": "ray"}


def test_an_unknown_profile_is_refused():
    with pytest.raises(RayProfileError, match="RAYPD_RAY_PROFILE='fast'"):
        apply_ray_profile({"RAYPD_RAY_PROFILE": "fast"})


def _ray_containers(doc: dict) -> list[dict]:
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"] if c["name"].startswith("ray-")]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.parent.name)
def test_every_ray_container_of_the_manifests_runs_the_serving_profile(path):
    containers = _ray_containers(yaml.safe_load(path.read_text()))
    assert len(containers) >= 2
    for container in containers:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {k: env.get(k) for k in SERVING_NODE_ENV} == SERVING_NODE_ENV, container["name"]
