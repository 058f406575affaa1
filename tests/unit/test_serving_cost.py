"""benchmarks/serving_cost.py's pure pieces (issue 55, item 5): a process's role from its title, the
CPU spent per role between two samples, and the rate arithmetic."""

from __future__ import annotations

import pytest

from benchmarks import serving_cost as sc


@pytest.mark.parametrize(("comm", "cmdline", "role"), [
    ("ray::EngineActo", "ray::EngineActor.generate_to", "EngineActors"),
    ("ray::ServeRepli", "ray::ServeReplica:raypd-serving-cost:RaypdIngress", "Serve replica (ingress)"),
    ("ray::ProxyActor", "ray::ProxyActor", "Serve proxy"),
    ("haproxy", "/usr/sbin/haproxy -f /tmp/x.cfg", "HAProxy (+ its manager)"),
    ("ray::Coordinato", "ray::Coordinator", "coordinator"),
    ("ray::Launcher", "ray::Launcher", "launcher"),
    ("ray::SyntheticR", "ray::SyntheticRankActor.generate_local", "synthetic ranks (the engines' compute)"),
    ("python", "python -m vllm.entrypoints.openai.api_server --model /m", "vLLM API server"),
    ("VLLM::EngineCor", "VLLM::EngineCore", "vLLM engine cores"),
    ("gcs_server", "/venv/ray/core/src/ray/gcs/gcs_server --x", "GCS"),
    ("python", "python -c import sys", sc.OTHER),
])
def test_each_process_gets_its_role(comm, cmdline, role):
    assert sc.role_of(comm, cmdline) == role


def test_cpu_spent_per_role_counts_new_processes_whole_and_sums_a_role():
    before = {1: ("EngineActors", 10.0), 2: ("EngineActors", 5.0), 3: ("GCS", 1.0)}
    after = {1: ("EngineActors", 12.0), 2: ("EngineActors", 5.5), 3: ("GCS", 1.25), 4: ("raylet", 0.5)}
    assert sc.spent(before, after) == {"EngineActors": 2.5, "GCS": 0.25, "raylet": 0.5}


def test_streams_offer_the_rate_and_a_core_bounds_the_rate():
    assert [sc.concurrency_for(r, 0.01) for r in (1000, 4000, 10000)] == [10, 40, 100]
    assert sc.core_limited_rate(0.25) == 4000.0
