"""vLLM's worker threads run at a higher nice value than their engine actor on a CPU host, so the serving path
runs first."""

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
        own = os.getpriority(os.PRIO_PROCESS, os.getpid())
        assert compute_priority.lower_compute_priority(7) == [worker.pid]
        threads = [int(t) for t in os.listdir(f"/proc/{worker.pid}/task")]
        assert len(threads) >= 2 and {os.getpriority(os.PRIO_PROCESS, t) for t in threads} == {min(19, own + 7)}
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
        own = os.getpriority(os.PRIO_PROCESS, os.getpid())
        assert compute_priority.lower_compute_priority(5) == [core.pid]
        assert os.getpriority(os.PRIO_PROCESS, core.pid) == min(19, own + 5)
    finally:
        core.kill()
        core.wait()


def test_the_compute_nice_value_is_relative_to_the_engine_actor_and_capped():
    assert compute_priority.compute_nice_for(10, 0) == 10
    assert compute_priority.compute_nice_for(10, 15) == 19  # a Ray worker (RAY_worker_niceness 15)
    assert compute_priority.compute_nice_for(2, 15) == 17


def test_under_an_actor_at_ray_s_worker_niceness_the_compute_runs_below_it_not_above(monkeypatch):
    # Ray starts its workers at nice 15: an absolute nice 10 would have put the compute ahead of the
    # engine actor, the ingress and the Serve proxy
    code = ("import os, subprocess, sys, time; os.nice(15 - os.nice(0)); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)")
    actor = subprocess.Popen([sys.executable, "-c", code])
    try:
        import psutil

        deadline = time.monotonic() + 10
        while not psutil.Process(actor.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (core,) = psutil.Process(actor.pid).children()
        assert os.getpriority(os.PRIO_PROCESS, core.pid) == 15  # inherited from the actor
        monkeypatch.setattr(compute_priority, "_title",
                            lambda pid: "VLLM::EngineCore" if pid == core.pid else "python")
        assert compute_priority.lower_compute_priority(10, root_pid=actor.pid) == [core.pid]
        assert os.getpriority(os.PRIO_PROCESS, core.pid) == 19
        assert os.getpriority(os.PRIO_PROCESS, actor.pid) == 15
    finally:
        for p in psutil.Process(actor.pid).children():
            p.kill()
        actor.kill()
        actor.wait()
