"""The start-up deadline follows the start time measured on the cluster (actors/control/startup_watch.py):
the operator's fixed deadline as it is; else a multiple of the longest start the engines reported at
their registration, with a floor; before any, the fallback. A restarted coordinator re-derives its
pending starts from the engine actors Ray still has (fakes, no Ray)."""

from __future__ import annotations

import asyncio

from actors.control.startup_watch import StartupDeadline, StartupWatch
from actors.engine.startup import HANDSHAKE_PUBLISHED, LOADING, PLACED, StartPhase, StartupLog
from serving.cluster.engines import startup_deadline
from serving.config import DeploymentConfig

from tests.unit.test_startup_watch import Clock, Ray

POLICY = StartupDeadline(fixed_s=None, fallback_s=1200.0, factor=3.0, floor_s=120.0)


def test_before_any_start_was_measured_the_deadline_is_the_fallback():
    assert POLICY.derive(None) == 1200.0


def test_a_measured_start_gives_its_multiple():
    assert POLICY.derive(50.0) == 150.0


def test_a_short_start_gives_the_floor():
    assert POLICY.derive(10.0) == 120.0


def test_a_fixed_deadline_is_used_as_it_is():
    assert StartupDeadline(fixed_s=30.0).derive(500.0) == 30.0


def test_the_config_sets_the_policy_with_the_backends_fallback():
    cfg = DeploymentConfig.from_dict({"name": "d", "backend": "vllm", "model": "m",
                                      "restarts": {"startup_deadline_factor": 2.0, "startup_deadline_floor_s": 60}})
    assert startup_deadline(cfg) == StartupDeadline(None, 1200.0, 2.0, 60.0)


def watch(**kw) -> tuple[StartupWatch, Ray, Clock]:
    ray, clock = Ray(), Clock()
    return StartupWatch(kill=ray.kill, state=ray.state, clock=clock, policy=POLICY, **kw), ray, clock


def test_the_watch_follows_the_longest_start_registered_and_a_fixed_one_overrides_it():
    w, _, _ = watch()
    seen = [w.deadline_s]
    for start_s in (60.0, 0.0, 45.0):  # 0: not measured
        w.registered("P", start_s)
        seen.append(w.deadline_s)
    w.deadline_s = 30.0  # the operator's restarts.startup_deadline_s
    assert seen + [w.deadline_s] == [1200.0, 180.0, 180.0, 180.0, 30.0]


def test_an_engine_is_killed_at_the_derived_deadline_not_the_fallback():
    w, ray, clock = watch()
    w.registered("D", 50.0)  # its first start took 50 s: the deadline is 150 s
    w.expect("D", "actor-D", "hung: no answer to a ping")
    clock.now += 149.0
    first = asyncio.run(w.sweep())
    clock.now += 1.0
    assert (first, asyncio.run(w.sweep()), ray.killed) == ([], ["D"], ["actor-D"])


def test_a_restarted_coordinator_awaits_the_engine_actors_that_did_not_register_again():
    registered: dict[str, object] = {}

    async def actors():
        return {"D": "actor-D", "P": "actor-P"}

    w, ray, clock = watch(actors=actors, registered=registered, settle_s=10.0, restarted=lambda: True)
    started = clock.now

    async def go():
        registered["P"] = object()  # P registered again within the settle time; D did not
        early = await w.sweep()
        clock.now += 10.0
        settled = await w.sweep()
        pending = w.pending()
        clock.now += 1200.0 - 10.0
        return early, settled, pending, await w.sweep()

    early, settled, pending, late = asyncio.run(go())
    assert (early, settled, pending, late, ray.killed) == ([], [], {"D": 1200.0 - 10.0}, ["D"], ["actor-D"])
    assert clock.now - started == 1200.0  # D's deadline counted from the coordinator's start


def test_a_first_coordinator_adopts_nothing():
    async def actors():
        return {"D": "actor-D"}  # in its first start: the launcher's to time out

    w, _, _ = watch(actors=actors, registered={}, settle_s=0.0, restarted=lambda: False)
    asyncio.run(w.sweep())
    assert w.pending() == {}


def test_adoption_happens_once():
    asked = []

    async def actors():
        asked.append(1)
        return {"D": "actor-D"}

    w, _, clock = watch(actors=actors, registered={}, settle_s=0.0, restarted=lambda: True)
    asyncio.run(w.sweep())
    w.registered("D", 20.0)
    asyncio.run(w.sweep())
    assert (len(asked), w.pending()) == (1, {})


def test_an_engine_reports_its_actors_creation_to_its_registration():
    log = StartupLog("e")
    log._phases = [StartPhase("e", PLACED, 100.0), StartPhase("e", LOADING, 101.0),
                   StartPhase("e", HANDSHAKE_PUBLISHED, 142.5)]
    assert log.start_s() == 42.5
