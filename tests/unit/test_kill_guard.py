"""The suite's false-kill guard (tests/kill_guard.py): which coordinator kills fail a test."""

from actors.control.ledger_records import EngineKills
from kill_guard import false_kills, new_kills, ray_running, read_kills


def test_no_new_kill_passes():
    counts = {"c1": EngineKills(hung={"d0": 1})}
    assert false_kills(counts, counts, injects_faults=False) is None


def test_a_kill_in_a_test_that_injects_no_fault_fails_it():
    before = {"c1": EngineKills(hung={"d0": 1})}
    after = {"c1": EngineKills(hung={"d0": 2}, startup_timeout={"p0": 1})}
    problem = false_kills(before, after, injects_faults=False)
    assert problem is not None and "{'hung': {'d0': 1}, 'startup_timeout': {'p0': 1}}" in problem, problem


def test_a_kill_in_a_test_that_injects_faults_passes():
    assert false_kills({}, {"c1": EngineKills(hung={"d0": 1})}, injects_faults=True) is None


def test_a_coordinator_first_seen_after_the_test_counts_from_zero():
    assert new_kills({"c1": EngineKills()}, {"c1": EngineKills(), "c2": EngineKills(startup_timeout={"p0": 2})}) == \
        {"startup_timeout": {"p0": 2}}


def test_a_restarted_coordinator_counts_from_zero_and_a_gone_one_is_not_compared():
    before = {"c1": EngineKills(hung={"d0": 3}), "c2": EngineKills(hung={"d1": 1})}
    after = {"c1": EngineKills(hung={"d0": 1})}  # c1 restarted (its counts went down), c2 is gone
    assert new_kills(before, after) == {"hung": {"d0": 1}}


def test_without_a_ray_session_nothing_is_read(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "ray", raising=False)  # as in a process that never used Ray
    assert (ray_running(), read_kills()) == (False, {})
