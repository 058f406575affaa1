"""vLLM's worker threads run at a higher nice value on a CPU host, so the serving path runs first."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from actors.engine.vllm import compute_priority


def test_every_thread_of_a_vllm_worker_below_us_gets_the_nice_value(monkeypatch):
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    worker = subprocess.Popen([sys.executable, "-c", code])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{worker.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        monkeypatch.setattr(compute_priority, "_title",
                            lambda pid: "VLLM::Worker" if pid == worker.pid else "python")
        assert compute_priority.lower_compute_priority(0) == []  # 0: left alone
        assert compute_priority.lower_compute_priority(7) == [worker.pid]
        threads = [int(t) for t in os.listdir(f"/proc/{worker.pid}/task")]
        assert len(threads) >= 2 and {os.getpriority(os.PRIO_PROCESS, t) for t in threads} == {7}
        assert os.getpriority(os.PRIO_PROCESS, other.pid) == os.getpriority(os.PRIO_PROCESS, os.getpid())
    finally:
        for p in (worker, other):
            p.kill()
            p.wait()


def test_an_engine_core_that_runs_the_model_itself_gets_the_nice_value(monkeypatch):
    # vLLM's uni executor: no worker process, the engine core computes (actors/engine/vllm/uniproc.py)
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        monkeypatch.setattr(compute_priority, "_title",
                            lambda pid: "VLLM::EngineCore" if pid == core.pid else "python")
        assert compute_priority.lower_compute_priority(5) == [core.pid]
        assert os.getpriority(os.PRIO_PROCESS, core.pid) == 5
    finally:
        core.kill()
        core.wait()
