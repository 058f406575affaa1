"""`scripts/gpu_check.sh --device cpu --smoke`, the device check's one command, end to end on this box.

Issue 27 runs the script once on a lent GPU machine, with no second try to spare. Here it runs as
it will there, but on CPU with tiny shapes. It logs the environment, installs the carried wheels
(none here: the tree's interpreter already has nixl), probes UCX's transports with one pull, then
runs the full benchmark with the first transport that passed. It must exit 0 and leave a results
file with every byte verified. (`test_gpu_kv_cpu.py` checks the benchmark's own results in detail.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_script_probes_a_transport_and_writes_a_verified_results_file(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "RAYPD_COMMIT": "test"}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--smoke", "--budget-s", "400"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    log = (tmp_path / "gpu_check.log").read_text()
    assert done.returncode == 0, log[-3000:]
    assert "probe 1 UCX_TLS=default: PASS" in log, log[-3000:]
    assert "## full run: --device cpu UCX_TLS=default" in log
    text = (tmp_path / "gpu_kv.txt").read_text()
    assert "bytes verified" in text and "FAILED" not in text
