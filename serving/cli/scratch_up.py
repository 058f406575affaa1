"""A throw-away `raypd up`: one deployment YAML started on a Ray temp dir and a port of its own, for as
long as a `with` block runs, then `raypd down` whatever happened and its files removed.

Used by the first-use measurement of a host (serving/cli/host_measure.py) and the planner's check
(benchmarks/plan_check.py). The block gets `ScratchUp`: the front's URL (healthy: every engine
registered) and the temp dir `raypd profile` / `raypd down` find it by.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from serving.bench.samples import free_port

RAYPD = [sys.executable, "-m", "serving.cli"]
ROOT = Path(__file__).resolve().parents[2]


class ScratchUpError(RuntimeError):
    """The deployment did not become healthy in time; the message holds the end of its log."""


@dataclass(frozen=True)
class ScratchUp:
    url: str
    temp_dir: str


@contextmanager
def scratch_up(config_yaml: str, start_timeout_s: float, port: int | None = None) -> Iterator[ScratchUp]:
    from serving.ops.health_probe import NotHealthy, wait_healthy

    work = Path(tempfile.mkdtemp(prefix="raypd-scratch-"))
    temp_dir, port = str(work / "ray"), port or free_port()
    (work / "config.yaml").write_text(config_yaml)
    log = open(work / "up.log", "w")
    up = subprocess.Popen([*RAYPD, "up", "--config", str(work / "config.yaml"), "--port", str(port),
                           "--temp-dir", temp_dir], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, start_timeout_s, proc=up, interval_s=1.0)
        except (NotHealthy, RuntimeError) as exc:  # not in time, or `raypd up` exited
            raise ScratchUpError(f"raypd up not healthy ({exc}); its log: {(work / 'up.log').read_text()[-1500:]}") \
                from None
        yield ScratchUp(url, temp_dir)
    finally:
        subprocess.run([*RAYPD, "down", "--temp-dir", temp_dir], cwd=ROOT, capture_output=True, timeout=300)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)
        log.close()
        shutil.rmtree(work, ignore_errors=True)
