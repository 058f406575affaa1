"""The engine's record of vLLM's processes: written once, checked per stats call without listing the host."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from actors.engine.vllm.orphans import Child, forget, live_pids, record_children, record_path


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def engine_id():
    eid = f"test-orphans-{uuid.uuid4().hex[:8]}"
    yield eid
    forget(eid)


def ours(recorded: tuple[Child, ...], child: subprocess.Popen) -> tuple[Child, ...]:
    """The fixture's child among what was recorded (the test process may have others: a Ray cluster)."""
    return tuple(c for c in recorded if c.pid == child.pid)


def test_a_recorded_child_is_live_and_in_the_record_file(child, engine_id):
    mine = ours(record_children(engine_id), child)
    assert live_pids(mine) == [child.pid]
    on_disk = json.loads(record_path(engine_id).read_text())
    assert [e for e in on_disk["children"] if e["pid"] == child.pid] == [{"pid": child.pid,
                                                                         "create_time": mine[0].create_time}]


def test_a_child_that_exited_is_no_longer_live(child, engine_id):
    mine = ours(record_children(engine_id), child)
    child.kill()
    child.wait()
    assert (len(mine), live_pids(mine)) == (1, [])


def test_a_reused_pid_is_not_taken_for_the_recorded_child(child):
    assert live_pids((Child(child.pid, create_time=1.0),)) == []
