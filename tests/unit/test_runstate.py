"""`raypd up`'s record: a per-user folder, and `down` signals only a live `raypd up` of this user."""

import os
import subprocess
import sys
import time

import pytest

from serving.cli import runstate
from serving.cli.runstate import UpState, is_raypd_up_cmdline, live_up_process


@pytest.fixture
def run_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "raypd"


def state_of(pid, **kw):
    return UpState(**{"pid": pid, "create_time": runstate.process_create_time(pid), "name": "n",
                      "url": "http://127.0.0.1:1", "config": None, "gcs_address": "127.0.0.1:2",
                      "started_cluster": True, "ray_auth_mode": "token", **kw})


def test_state_file_is_per_user_private_and_per_temp_dir(run_dir, monkeypatch, tmp_path):
    path = runstate.write_state("/tmp/a", state_of(os.getpid()))
    assert path.parent == run_dir and oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    assert runstate.read_state("/tmp/a").pid == os.getpid() and runstate.read_state("/tmp/b") is None
    runstate.remove_state("/tmp/a", pid=os.getpid() + 1)  # someone else's record stays
    assert runstate.read_state("/tmp/a") is not None
    runstate.remove_state("/tmp/a", pid=os.getpid())
    assert runstate.read_state("/tmp/a") is None
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runstate.run_dir() == tmp_path / "home" / ".cache" / "raypd" / "run"


@pytest.mark.parametrize("argv, ok", [
    (["/v/bin/python", "/v/bin/raypd", "up", "--model", "x"], True),
    (["python", "-m", "serving.cli", "up"], True),
    (["/usr/bin/python3.11", "-u", "-m", "serving.cli", "up", "--config", "x"], True),
    (["python", "-c", "import time", "raypd", "up"], False),
    (["python", "-m", "serving.cli", "down"], False),
    (["/v/bin/raypd", "status"], False),
    (["sleep", "100"], False),
    (["python", "up.py", "raypd"], False),
])
def test_raypd_up_command_lines(argv, ok):
    assert is_raypd_up_cmdline(argv) is ok


def test_only_a_live_raypd_up_of_the_record_may_be_signalled(tmp_path):
    script = tmp_path / "raypd"  # looks like the raypd entry point running `up`
    script.write_text("import time\ntime.sleep(60)\n")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "raypd", "up"])
    fake_up = subprocess.Popen([sys.executable, str(script), "up"])
    try:
        time.sleep(0.2)
        assert "is not `raypd up`" in live_up_process(state_of(sleeper.pid))
        assert live_up_process(state_of(fake_up.pid)) is None
        reused = state_of(fake_up.pid, create_time=runstate.process_create_time(fake_up.pid) - 100)
        assert "another process" in live_up_process(reused)
        gone = state_of(fake_up.pid)
    finally:
        for p in (sleeper, fake_up):
            p.kill()
            p.wait()
    assert "not running" in live_up_process(gone)


def test_down_refuses_to_signal_a_pid_that_is_not_its_raypd_up(run_dir, capsys):
    from serving.cli.main import main

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        runstate.write_state("/tmp/raypd-down-test", state_of(victim.pid))
        assert main(["down", "--temp-dir", "/tmp/raypd-down-test"]) == 0
        assert victim.poll() is None  # not signalled
        assert "not signalling" in capsys.readouterr().err
        assert runstate.read_state("/tmp/raypd-down-test") is None  # the stale record is gone
    finally:
        victim.kill()
        victim.wait()
