"""vLLM's compute in a scheduling group of its own under autogroup (actors/engine/vllm/compute_group.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from actors.engine.vllm.compute_group import autogroup_enabled, leave_session, set_group_nice

ROOT = Path(__file__).resolve().parents[2]


def sysctl(tmp_path: Path, value: str) -> Path:
    path = tmp_path / "sched_autogroup_enabled"
    path.write_text(value + "\n")
    return path


def test_autogroup_is_read_from_the_kernel_setting(tmp_path):
    assert autogroup_enabled(sysctl(tmp_path, "1"))
    assert not autogroup_enabled(sysctl(tmp_path, "0"))
    assert not autogroup_enabled(tmp_path / "missing")


def leaves_in_a_child(on_cpu: bool, setting: Path) -> str:
    code = ("import os; from pathlib import Path; from actors.engine.vllm.compute_group import leave_session; "
            f"did = leave_session({on_cpu}, Path({str(setting)!r})); "
            "print(did, os.getsid(0) == os.getpid())")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_process_on_a_cpu_host_with_autogroup_leads_a_session_of_its_own(tmp_path):
    assert leaves_in_a_child(True, sysctl(tmp_path, "1")) == "True True"


def test_without_autogroup_or_off_the_cpu_the_process_stays_in_its_parents_session(tmp_path):
    assert leaves_in_a_child(True, sysctl(tmp_path, "0")) == "False False"
    assert leaves_in_a_child(False, sysctl(tmp_path, "1")) == "False False"


def test_the_group_nice_is_written_for_a_session_leader_only(tmp_path):
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    member = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for pid in (leader.pid, member.pid):
            (tmp_path / str(pid)).mkdir()
        assert set_group_nice(leader.pid, 19, proc=tmp_path)
        assert (tmp_path / str(leader.pid) / "autogroup").read_text() == "19"
        assert not set_group_nice(member.pid, 19, proc=tmp_path)
        assert not (tmp_path / str(member.pid) / "autogroup").exists()
    finally:
        for p in (leader, member):
            p.kill()
            p.wait()


def test_a_process_that_is_gone_is_no_error(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    gone.wait()
    assert not set_group_nice(gone.pid, 19, proc=tmp_path)
