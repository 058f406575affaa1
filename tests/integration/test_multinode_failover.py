"""A node dies under load on a simulated multi-node cluster (in a subprocess: the script owns its cluster)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("multinode_failover.py")


@pytest.mark.slow
def test_a_decode_node_dies_mid_run_and_its_engine_is_replaced_with_every_answer_verified():
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(lines[-1])
    assert "error" not in r, r  # the run went through every step
    # placement follows the node labels; every rank sits with its engine
    assert sorted(r["placed"].values()) == ["Da", "Db", "P", "P"] and r["ranks_follow"], r
    assert r["reference"] == {"ok": 200}, r
    # the node loss: no wrong answer, no cut connection; streams on the dead engine moved to the other one
    assert r["failover"].get("different", 0) == 0 and r["failover"].get("cut", 0) == 0, r
    assert r["failover"].get("equal", 0) + r["failover"].get("failed_clean", 0) == 200, r
    assert r["failover"] == {"equal": 200}, r  # exact: migration takes every stream over
    assert r["decodes_after_kill"] == ["mnf-decode-1"] and r["d0_removed_as_dead"], r
    # replaced on the spare node, serving again, every answer right
    assert r["replaced_on_spare"] and r["final"] == {"equal": 40} and r["final_on_replaced"] > 0, r
    # nothing stranded
    assert all(r["blocks_at_baseline"].values()) and len(r["blocks_at_baseline"]) == 4, r
    assert r["placement_groups_left"] == [], r
