"""The engine's record of vLLM's processes: written once, checked per stats call without listing the host."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from actors.engine.vllm.orphans import Child, forget, live_pids, reap_previous, record_children, record_path


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


def _record_of_an_earlier_incarnation(engine_id: str, entries: list[dict]) -> None:
    record_path(engine_id).write_text(json.dumps({"parent": -1, "children": entries}))


def test_an_earlier_incarnations_recorded_child_is_reaped(child, engine_id):
    import psutil

    started = psutil.Process(child.pid).create_time()
    _record_of_an_earlier_incarnation(engine_id, [{"pid": child.pid, "create_time": started}])
    assert (reap_previous(engine_id, grace_s=5.0), child.wait(timeout=10) is not None) == ([child.pid], True)


def test_a_process_that_only_shares_a_recorded_pid_is_not_reaped(child, engine_id):
    _record_of_an_earlier_incarnation(engine_id, [{"pid": child.pid, "create_time": 1.0}])
    assert (reap_previous(engine_id), child.poll()) == ([], None)
