"""Incarnations Ray declared dead are never registered again (actors/control/fence.py)."""

import pytest

from actors.control.fence import DeadIncarnations
from actors.control.registry import RegistrationError
from actors.protocol.registration import EngineInfo

DEAD = EngineInfo("vllm", "m", pid=41, node_id="n1", actor_id="a1")


def test_a_dead_incarnation_is_refused_and_counted_a_restart_by_ray_is_not():
    fence = DeadIncarnations()
    fence.died("e", DEAD)
    assert fence.refuses("e", DEAD) and fence.refused == 1
    restarted = EngineInfo("vllm", "m", pid=77, node_id="n2", actor_id="a1")  # Ray's restart: a new process
    assert not fence.refuses("e", restarted)
    assert not fence.refuses("other", DEAD)  # another engine's id
    assert fence.refused == 1


def test_an_incarnation_without_a_process_or_actor_id_is_never_fenced():
    fence = DeadIncarnations()
    for info in (EngineInfo(), EngineInfo(pid=41, node_id="n1")):
        fence.died("e", info)
        assert not fence.refuses("e", info)
    assert not fence.refuses("e", None)


def test_only_the_last_incarnations_are_kept():
    fence = DeadIncarnations(capacity=2)
    for pid in (1, 2, 3):
        fence.died("e", EngineInfo(pid=pid, actor_id="a"))
    assert [fence.refuses("e", EngineInfo(pid=p, actor_id="a")) for p in (1, 2, 3)] == [False, True, True]


class ActorDiedError(Exception):
    """Named as Ray's: the fence tells Ray's death apart by name (it imports no Ray)."""


class Handle:
    def __init__(self, hex_id):
        self._actor_id = type("ActorID", (), {"hex": lambda self: hex_id})()


def test_only_the_registering_actors_own_death_fences_it():
    fence = DeadIncarnations()
    fence.watch_failed("e", DEAD, Handle("rank-7"), ActorDiedError())  # a rank died: the process lives on
    fence.watch_failed("e", DEAD, Handle("a1"), TimeoutError())  # not Ray's verdict of death
    assert not fence.refuses("e", DEAD)
    fence.watch_failed("e", DEAD, Handle("a1"), ActorDiedError())
    assert fence.refuses("e", DEAD)


def test_the_coordinator_is_told_by_a_typed_error():
    fence = DeadIncarnations()
    fence.died("e", DEAD)
    with pytest.raises(RegistrationError, match="dead in Ray's view"):
        fence.check("e", DEAD)
    fence.check("e", EngineInfo("vllm", "m", pid=77, node_id="n2", actor_id="a1"))  # a new process: fine
