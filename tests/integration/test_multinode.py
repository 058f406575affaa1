"""Multi-node placement on a simulated cluster (three Ray nodes on loopback, in a subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("multinode_scenario.py")


def run(backend: str, timeout: int) -> dict:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(SCRIPT), backend], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=Path(__file__).resolve().parents[2])
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def check(result: dict) -> None:
    assert result["prefill_on_a"] and result["decode_on_b"], result
    assert result["prefill_ranks_on_a"] and result["decode_ranks_on_b"], result
    assert result["coordinator_on_head"], result
    assert result["status"] == 200, result
    assert result["prefill_requests"] == 1 and result["fallbacks"] == {}, result  # P/D, not the fallback
    assert result["transfer_failures"] == 0 and result["recomputed"] == 0, result
    assert result["placement_groups_left"] == [], result


@pytest.mark.slow
def test_synthetic_prefill_on_node_a_decode_on_node_b():
    result = run("synthetic", timeout=600)
    check(result)
    assert result["prefill_ranks"] == 2  # tp=2: both rank actors followed their engine
    # scaling up goes through the same placement: refused without a `prefill` node, placed on the new one
    assert (result["scale_unschedulable"], result["scale_pg_left_after_refusal"], result["scaled_prefill_on_c"]) \
        == (True, [], True), result


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_prefill_on_node_a_decode_on_node_b():
    result = run("vllm", timeout=1500)
    check(result)
    assert "Paris" in result["text"], result
    assert result["decode_pulls"] == 1 and result["recomputed"] == 0, result
